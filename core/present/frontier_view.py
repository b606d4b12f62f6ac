"""The frontier without Streamlit: its scatter (error against speed, the Pareto front drawn) and
its table in words."""

from __future__ import annotations

from typing import Any

import pandas as pd

from core.present.palette import dtype_color_encoding


def frontier_frame(result: Any) -> pd.DataFrame:
    rows = []
    for c in result.configs:
        if c["skipped"]:
            continue
        rows.append({"configuration": c["name"], "dtype": c["dtype"], "mean gap": c["ref_gap"]["mean"],
                     "largest gap": c["ref_gap"]["max"], "exact KL": c["ref_gap"]["kl_mean"],
                     "prefill tokens/s": c["tokens_per_s"]["prefill"], "generate tokens/s": c["tokens_per_s"]["generate"],
                     "on the front": bool(c.get("pareto"))})
    return pd.DataFrame(rows)


def scatter(result: Any) -> Any:
    """Mean gap to float64 (lower is more accurate) against prefill tokens/s (right is faster); the
    Pareto front joined by a line, the tolerance a dashed rule, the recommendation ringed."""
    import altair as alt

    df = frontier_frame(result)
    df["gap (plot)"] = df["mean gap"].clip(lower=1e-10)
    tip = [alt.Tooltip("configuration:N"), alt.Tooltip("mean gap:Q", format=".3e"), alt.Tooltip("largest gap:Q", format=".3e"),
           alt.Tooltip("exact KL:Q", format=".3e"), alt.Tooltip("prefill tokens/s:Q", format=",.0f"),
           alt.Tooltip("generate tokens/s:Q", format=",.0f")]
    x = alt.X("prefill tokens/s:Q", scale=alt.Scale(type="log"), title="speed: prefill tokens/s (log scale, right is faster)")
    y = alt.Y("gap (plot):Q", scale=alt.Scale(type="log"), title="error: mean |Δ logp| to float64 (log scale, lower is better)")
    points = alt.Chart(df).mark_point(size=140, filled=True).encode(x=x, y=y, color=dtype_color_encoding(df["dtype"]), tooltip=tip)
    labels = alt.Chart(df).mark_text(align="left", dx=9, fontSize=11).encode(x=x, y=y, text="configuration:N")
    front = alt.Chart(df[df["on the front"]].sort_values("prefill tokens/s")).mark_line(color="#111827", strokeDash=[2, 2]).encode(
        x=x, y=y, order="prefill tokens/s:Q")
    layers = [front, points, labels]
    tol = result.tolerance.get("value")
    if tol:
        layers.append(alt.Chart(pd.DataFrame({"tolerance": [tol]})).mark_rule(color="#D55E00", strokeDash=[6, 4]).encode(y="tolerance:Q"))
    name = result.recommendation.get("name")
    if name:
        layers.append(alt.Chart(df[df["configuration"] == name]).mark_point(size=600, shape="circle", color="#009E73", strokeWidth=2)
                      .encode(x=x, y=y))
    return alt.layer(*layers, title="Accuracy against speed: the dashed line joins the configurations nothing beats on both")
