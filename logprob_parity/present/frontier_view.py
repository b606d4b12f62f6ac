"""The frontier without Streamlit: its scatter (error against speed, the Pareto front drawn) and
its table in words."""

from __future__ import annotations

from typing import Any

import pandas as pd

from logprob_parity.present.palette import dtype_color_encoding


def frontier_frame(result: Any) -> pd.DataFrame:
    rows = []
    for c in result.configs:
        if c["skipped"]:
            continue
        rows.append(
            {
                "configuration": c["name"],
                "dtype": c["dtype"],
                "mean gap": c["ref_gap"]["mean"],
                "largest gap": c["ref_gap"]["max"],
                "exact KL": c["ref_gap"]["kl_mean"],
                "prefill tokens/s": c["tokens_per_s"]["prefill"],
                "generate tokens/s": c["tokens_per_s"]["generate"],
                "slowest": (c["tokens_per_s"].get("prefill_spread") or [c["tokens_per_s"]["prefill"]] * 2)[0],
                "fastest": (c["tokens_per_s"].get("prefill_spread") or [c["tokens_per_s"]["prefill"]] * 2)[1],
                "on the front": bool(c.get("pareto")),
            }
        )
    return pd.DataFrame(rows)


def scatter(result: Any) -> Any:
    """Mean gap to float64 (lower is more accurate) against prefill tokens/s (right is faster); the
    Pareto front joined by a line, the tolerance a dashed rule, the recommendation ringed."""
    import altair as alt

    df = frontier_frame(result)
    df["gap (plot)"] = df["mean gap"].clip(lower=1e-10)
    tip = [
        alt.Tooltip("configuration:N"),
        alt.Tooltip("mean gap:Q", format=".3e"),
        alt.Tooltip("largest gap:Q", format=".3e"),
        alt.Tooltip("exact KL:Q", format=".3e"),
        alt.Tooltip("prefill tokens/s:Q", format=",.0f"),
        alt.Tooltip("generate tokens/s:Q", format=",.0f"),
    ]
    x = alt.X("prefill tokens/s:Q", scale=alt.Scale(type="log"), title="speed: prefill tokens/s (log scale, right is faster)")
    y = alt.Y("gap (plot):Q", scale=alt.Scale(type="log"), title="error: mean |Δ logp| to float64 (log scale, lower is better)")
    points = (
        alt.Chart(df).mark_point(size=140, filled=True).encode(x=x, y=y, color=dtype_color_encoding(df["dtype"]), tooltip=tip)
    )
    # names on the front only: a grid's many near-equal configurations would print over each other
    # (every point names itself in its tooltip, and the table lists them all)
    named = df[df["on the front"]].sort_values("prefill tokens/s")
    # neighbours on the front alternate above and below their points
    labels = [
        alt.Chart(named.iloc[i::2]).mark_text(align="left", dx=9, dy=dy, fontSize=11).encode(x=x, y=y, text="configuration:N")
        for i, dy in ((0, 9), (1, -9))
    ]
    front = (
        alt.Chart(df[df["on the front"]].sort_values("prefill tokens/s"))
        .mark_line(color="#111827", strokeDash=[2, 2])
        .encode(x=x, y=y, order="prefill tokens/s:Q")
    )
    # each point's spread over the repeats: a horizontal bar from its slowest to its fastest
    bars = (
        alt.Chart(df)
        .mark_rule(strokeWidth=2, opacity=0.6)
        .encode(x="slowest:Q", x2="fastest:Q", y=y, color=dtype_color_encoding(df["dtype"]))
    )
    layers = [front, bars, points, *labels]
    tol = result.tolerance.get("value")
    if tol:
        layers.append(
            alt.Chart(pd.DataFrame({"tolerance": [tol]})).mark_rule(color="#D55E00", strokeDash=[6, 4]).encode(y="tolerance:Q")
        )
    name = result.recommendation.get("name")
    if name:
        layers.append(
            alt.Chart(df[df["configuration"] == name])
            .mark_point(size=600, shape="circle", color="#009E73", strokeWidth=2)
            .encode(x=x, y=y)
        )
    return alt.layer(
        *layers,
        title=alt.TitleParams(
            "Accuracy against speed",
            subtitle=[
                "the dashed line joins the configurations nothing beats on both (named);",
                "bars span each one's repeats; hover a point for the others",
            ],
        ),
    ).properties(height=420, width=760)


def frontier_report_html(result: Any) -> str:
    """A self-contained page: the recommendation, what did not run and why, the scatter (SVG) and
    the table, every number at full precision in e-notation; all text escaped."""
    import html

    from logprob_parity.analysis.frontier import frontier_table
    from logprob_parity.present.report import _PAGE_CSS, _svg

    e = html.escape
    rec = result.recommendation
    head = (
        f"<p><b>Recommended: {e(rec['name'])}.</b> It is {e(rec['why'])}.</p>"
        if rec.get("name")
        else f"<p><b>No recommendation.</b> {e(rec['why'])}.</p>"
    )
    skipped = "".join(f"<li><b>{e(c['name'])}</b> did not run: {e(c['skipped'])}</li>" for c in result.configs if c["skipped"])
    no_kl = "".join(
        f"<li><b>{e(c['name'])}</b> has no exact KL: {e(c['ref_gap']['kl_why'])}</li>"
        for c in result.configs
        if (c["ref_gap"] or {}).get("kl_why")
    )
    meta_rows = [
        ("frontier", result.frontier_id),
        ("model", result.model),
        ("device", result.device),
        ("versions", " · ".join(f"{k} {v}" for k, v in result.versions.items() if v)),
        ("tokens", result.n_tokens),
        (
            "tolerance",
            "none"
            if result.tolerance.get("value") is None
            else f"{result.tolerance['value']:.3e} ({result.tolerance['source']})",
        ),
        ("created", result.created),
    ]
    meta = "".join(f"<tr><th class=l>{e(k)}</th><td class=l>{e(str(v))}</td></tr>" for k, v in meta_rows)
    rows = [r for r in frontier_table(result) if not r["skipped"]]
    cols = [c for c in (rows[0] if rows else {}) if c != "skipped"]

    def cell(col: str, v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else ""
        if isinstance(v, float):
            return f"{v:,.0f}" if "tokens/s" in col else (f"{v:.1f}" if col.endswith(" s") else f"{v:.3e}")
        return e(str(v))

    table = (
        "<table><tr>"
        + "".join(f"<th>{e(c)}</th>" for c in cols)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td{' class=l' if c == 'configuration' else ''}>{cell(c, r[c])}</td>" for c in cols) + "</tr>"
            for r in rows
        )
        + "</table>"
    )
    texts = (
        f"<details><summary>{len(result.texts)} text(s)</summary>"
        + "".join(f"<pre>{e(t)}</pre>" for t in result.texts)
        + "</details>"
    )
    chart = _svg(scatter(result)) if rows else ""
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>logprob-parity frontier {e(result.frontier_id)}</title>"
        f"<style>{_PAGE_CSS}</style></head><body><h1>Accuracy against speed: {e(result.model)}</h1>{head}"
        + (f"<ul>{skipped}{no_kl}</ul>" if skipped or no_kl else "")
        + f"<table class=meta>{meta}</table><h2>Error against speed</h2><div class=charts>{chart}</div>"
        f"<h2>Every configuration</h2>{table}<p>Every configuration scored the same token ids; the reference is HF in "
        "float64. The exact KL sums over the whole vocabulary. Prefill: scoring every token of the text; generate: greedy "
        f"tokens a second.</p><h2>Texts</h2>{texts}</body></html>"
    )


def write_frontier_report(result: Any, out: Any) -> None:
    """.html (self-contained) or .json (the `frontier --json` shape)."""
    import json

    from logprob_parity.present.report import write_by_suffix

    write_by_suffix(
        out,
        {
            ".html": lambda tmp: tmp.write_text(frontier_report_html(result), encoding="utf-8"),
            ".json": lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=1, allow_nan=False), encoding="utf-8"),
        },
    )
