"""A self-contained HTML report: styles, data and charts (as SVG) inline, so it opens offline."""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from pathlib import Path

from logprob_parity.analysis.verdict import hf_noise_of, run_verdicts
from logprob_parity.paths import write_text_atomic
from logprob_parity.present.charts import CHARTS, chart_frame, worst_tokens
from logprob_parity.present.labels import cell_text, summary_label, summary_value, token_shown
from logprob_parity.present.render import token_view_html, verdict_html
from logprob_parity.results.records import DiagnosticsResult
from logprob_parity.results.run import Run

MAX_SEQUENCES = 50
CARD_KEYS = ("n_tokens", "max_abs_delta", "mean_abs_delta", "p95_abs_delta", "argmax_agreement", "kl_full_mean", "mean_kl_topk")

_PAGE_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#111;padding:0 1em}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:2em}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f5f5f5} td.l,th.l{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:1em} .charts svg{max-width:100%;height:auto}
.meta td{text-align:left}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;padding:.6em}
"""


def write_by_suffix(out: str | os.PathLike, writers: dict[str, Callable[[Path], None]]) -> None:
    """Write `out` with the writer for its suffix (".htm" counts as ".html") into a temp file beside
    it, then rename: a half-written report is never found under its name."""
    from logprob_parity.errors import UserError

    out = Path(out)
    suffix = ".html" if out.suffix.lower() == ".htm" else out.suffix.lower()
    if suffix not in writers:
        names = list(writers)
        allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise UserError(f"report output must end in {allowed} (got {out.name})")
    tmp = out.with_name(f".{out.name}.tmp")
    writers[suffix](tmp)
    os.replace(tmp, out)


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _num(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return _e(v)


def _svg(chart: object) -> str:
    try:
        import vl_convert as vlc
    except ImportError:
        return "<p>(charts need vl-convert-python)</p>"
    return vlc.vegalite_to_svg(chart.to_json())  # type: ignore[attr-defined]


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = [c for c in rows[0] if c not in ("run_id", "note")] + (["note"] if "note" in rows[0] else [])
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(cell_text(c, r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def diagnostics_section(diag: dict) -> str:
    from logprob_parity.analysis.diagnostics import ablation_table, diagnostics_tables, knob_lines

    tables = diagnostics_tables(diag)
    tables["ablation"] = ablation_table(tables["ablation"])
    titles = {
        "noise": "Noise floor: the vLLM–HF gap beside each engine's disagreement with itself",
        "ratios": "The gap against each engine's own noise",
        "reference": "High-precision reference (HF in float64 on the CPU)",
        "downstream": "Downstream: generated text and multiple-choice answers",
        "layers": "Where in the network: each layer's blocks, vLLM against HF, HF's own floor and float64",
        "ablation": "Setting by setting: the gap with one engine setting changed",
    }
    parts = [f"<h2>Diagnostics</h2><p>diagnostics {_e(diag.diagnostics_id)}</p>"]
    for key, title in titles.items():
        if tables[key]:
            parts.append(f"<h3>{_e(title)}</h3>{_table(tables[key])}")
        if key == "layers":  # the layer part's answer in words, above or instead of its table
            for d, out in diag.dtypes.items():
                if out.layers:
                    said = out.layers.get("words") or f"the layer part did not run: {out.layers.get('why')}"
                    parts.append(f"<p><b>{_e(d)}</b>: {_e(said)}</p>")
    knobs = knob_lines(list(diag.ablation))
    if knobs:
        parts.append("<p>Setting by setting:</p><ul>" + "".join(f"<li>{_e(k)}</li>" for k in knobs) + "</ul>")
    return "".join(parts)


def report_html(runs: list[Run], diagnostics: DiagnosticsResult | None = None) -> str:
    first = runs[0]
    m = first.meta
    title = f"logprob-parity: {m.model} · {', '.join(r.dtype for r in runs)}"
    meta_rows = [
        ("model", m.model),
        ("revision", m.revision or "local folder (weights hashed)"),
        ("device", m.env.device),
        ("torch / transformers / vLLM", f"{m.env.torch} / {m.env.transformers} / {m.env.vllm}"),
        ("top-k / BOS policy", f"{m.top_k} / {m.bos}"),
        ("engine settings", json.dumps(m.settings, sort_keys=True)),
    ] + [(f"run id ({r.dtype})", f"{r.run_id}  created {r.meta.created}") for r in runs]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_PAGE_CSS}</style></head><body>"
    ]
    parts.append(f"<h1>{_e(title)}</h1>")
    parts.append(
        "<table class='meta'>"
        + "".join(f"<tr><th class='l'>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in meta_rows)
        + "</table>"
    )

    from logprob_parity.present.labels import quantized_words

    if quantized_words(m.settings):
        parts.append(f"<p><b>{_e(quantized_words(m.settings))}</b></p>")
    parts.append("<h2>Verdict</h2>" + verdict_html([v.to_dict() for v in run_verdicts(runs, diagnostics)]))
    parts.append(
        "<h2>Summary</h2><table><tr><th class='l'>metric</th>" + "".join(f"<th>{_e(r.dtype)}</th>" for r in runs) + "</tr>"
    )
    for key in first.summary:
        parts.append(
            f"<tr><td class='l'>{_e(summary_label(key))}</td>"
            + "".join(f"<td>{_e(summary_value(key, r.summary.get(key)))}</td>" for r in runs)
            + "</tr>"
        )
    parts.append("</table>")

    df = chart_frame(runs)
    if not df.empty:
        parts.append("<h2>Charts</h2>")
        for d, n_all in df.attrs.get("thinned", {}).items():
            parts.append(
                f"<p>{_e(d)}: {n_all:,} positions; the charts draw the largest gaps and an even sample of the rest "
                f"({int((df['dtype'] == d).sum()):,} points).</p>"
            )
        parts.append("<div class='charts'>")
        parts.extend(f"<div>{_svg(make(df).properties(width=480, height=260))}</div>" for make in CHARTS.values())
        parts.append("</div>")

    worst = worst_tokens(runs, 20)
    if not worst.empty:
        parts.append("<h2>Worst 20 tokens</h2><table><tr>" + "".join(f"<th>{_e(c)}</th>" for c in worst.columns) + "</tr>")
        by_dtype = {r.dtype: r for r in runs}
        for _, row in worst.iterrows():
            raw = by_dtype[row["dtype"]].sequences[int(row["prompt"]) - 1].tokens[int(row["position"])]
            cells = "".join(
                f"<td class='l'>{_e(token_shown(v, raw))}</td>" if c == "token" else f"<td>{_num(v)}</td>" for c, v in row.items()
            )
            parts.append(f"<tr>{cells}</tr>")
        parts.append("</table>")

    if diagnostics:
        parts.append(diagnostics_section(diagnostics))
    noise = hf_noise_of(runs, diagnostics)
    floors = {d: x["tail"] for d, x in noise.items() if x.get("tail") is not None} or None
    words = {d: x.get("tail_words") for d, x in noise.items()}
    n = min(len(first.sequences), MAX_SEQUENCES)
    parts.append(
        f"<h2>Tokens</h2><p>Hover a token for both logprobs, ranks and top-5 lists. Showing {n} of {len(first.sequences)} prompts.</p>"
    )
    for i in range(n):
        s = first.sequences[i]
        parts.append(f"<h3>Prompt {i + 1}</h3><pre>{_e(s.text)}</pre>")
        parts.append(token_view_html(runs, i, floors=floors, floor_words=words))
    parts.append("</body></html>")
    return "".join(parts)


def write_html_report(runs: Run | list[Run], path: str | os.PathLike, diagnostics: DiagnosticsResult | None = None) -> None:
    write_text_atomic(path, report_html([runs] if isinstance(runs, Run) else runs, diagnostics))
