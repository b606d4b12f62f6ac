"""A diagnosis as text for the terminal: the verdicts, each table in words, the ablation line by line."""

from __future__ import annotations

from logprob_parity.analysis.diagnostics import ablation_table, diagnostics_tables, knob_lines
from logprob_parity.analysis.verdict import diagnosis_verdicts
from logprob_parity.results.records import DiagnosticsResult


def diagnostics_text(result: DiagnosticsResult) -> str:
    import pandas as pd

    from logprob_parity.present.labels import cell_text

    lines = [f"diagnostics {result.diagnostics_id}  model {result.model}  device {result.device}"]
    for v in diagnosis_verdicts(result).values():
        lines += ["", f"[{v.title.upper()}] {v.headline}"] + [f"  - {r}" for r in v.reasons]
    for d, out in result.dtypes.items():
        if out.layers:
            words = out.layers.get("words") or f"the layer part did not run: {out.layers.get('why')}"
            lines += ["", f"Where in the network ({d}, text {out.layers.get('text', 0) + 1}): {words}"]
    for name, rows in diagnostics_tables(result).items():
        rows = ablation_table(rows) if name == "ablation" else rows
        if rows:
            lines += ["", f"== {name} =="]
            df = pd.DataFrame(rows).drop(columns=["run_id"], errors="ignore")
            df = df.astype(object).apply(lambda col: [cell_text(str(col.name), v) for v in col])
            lines.append(df.to_string(index=False))
    knobs = knob_lines(list(result.ablation))
    if knobs:
        lines += ["", "Setting by setting:"] + [f"  - {k}" for k in knobs]
    if result.mcq_dtype_flips:
        lines += ["", "MCQ answer flips between dtypes: " + ", ".join(f"{k}: {v}" for k, v in result.mcq_dtype_flips.items())]
    return "\n".join(lines)
