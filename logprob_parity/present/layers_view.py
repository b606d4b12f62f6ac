"""The layer part drawn: a layer x token heat map of vLLM's relative error against HF (routing flips
marked), and a line per engine of its error against float64 by layer. Reads the profile that
logprob_parity.analysis.layers stores; computes nothing new."""

from __future__ import annotations

from typing import Any

import pandas as pd

from logprob_parity.analysis.layers import block_words

FLOOR = 1e-12  # an error of exactly 0 drawn here on the log colour scale
FLIPPED, BEYOND, WITHIN = "routed to other experts", "beyond HF's noise", "within HF's noise"
OUTLINES = {FLIPPED: "#ff2b2b", BEYOND: "#111111", WITHIN: "transparent"}


def heat_frame(p: dict[str, Any], block: str, pieces: list[str] | None = None) -> pd.DataFrame:
    """One row per (layer, token) of a block: the relative error, the layer's floor, beyond it or not,
    and whether that token's router picked other experts at that layer."""
    floors = {r["layer"]: r["floor"] for r in p["per_layer"] if r["block"] == block}
    flips = {(f[1], f[0]) for f in (p.get("routing") or {}).get("flips", [])}
    # an error of exactly 0 (a first token both engines compute alike) is drawn at half the smallest
    # other one: a colour scale down to FLOOR would paint every other cell one colour
    positive = [e for errs in p["vllm_vs_hf"][block] for e in errs if e > 0]
    zero_at = min(positive) / 2 if positive else FLOOR
    recs = []
    for layer, errs in enumerate(p["vllm_vs_hf"][block]):
        for i, e in enumerate(errs):
            recs.append(
                {
                    "layer": layer,
                    "token": i,
                    # a token that holds only part of a character adds no text: say so, as the token view does
                    "piece": (pieces[i] or "(part of a character)") if pieces and i < len(pieces) else str(i),
                    "relative_error": float(e) if e > 0 else zero_at,
                    "floor": floors[layer],
                    "beyond": bool(e > floors[layer]),
                    "flipped": (layer, i) in flips,
                    "outline": FLIPPED if (layer, i) in flips else (BEYOND if e > floors[layer] else WITHIN),
                }
            )
    return pd.DataFrame.from_records(recs)


def line_frame(p: dict[str, Any], block: str = "resid") -> pd.DataFrame:
    """Per layer of one block: each engine's median error against float64, vLLM's against HF, and HF's floor."""
    recs = []
    for r in p["per_layer"]:
        if r["block"] != block:
            continue
        for series, value in (
            ("vLLM against float64", r["vllm_vs_ref_median"]),
            ("HF against float64", r["hf_vs_ref_median"]),
            ("vLLM against HF", r["vllm_vs_hf_median"]),
            ("the floor (HF against itself, at least rounding)", r["floor"]),
        ):
            recs.append({"layer": r["layer"], "series": series, "median_relative_error": max(float(value), FLOOR)})
    return pd.DataFrame.from_records(recs)


def heat_map(df: pd.DataFrame, title: str) -> Any:
    """Layers down, tokens across; the colour is the relative error on a log scale, a black outline marks
    a token beyond HF's own noise at that layer, a red one a token routed to other experts there."""
    import altair as alt

    base = alt.Chart(df).encode(
        x=alt.X("token:O", title="token (position in the text)", axis=alt.Axis(labelAngle=0, labelOverlap=True)),
        y=alt.Y("layer:O", title="layer", sort="ascending"),
        tooltip=[
            "layer:O",
            "token:O",
            alt.Tooltip("piece:N", title="token text"),
            alt.Tooltip("relative_error:Q", title="relative error, vLLM vs HF", format=".2e"),
            alt.Tooltip("floor:Q", title="HF's own floor at this layer", format=".2e"),
            alt.Tooltip("beyond:N", title="beyond HF's noise"),
            alt.Tooltip("flipped:N", title="routed to other experts"),
        ],
    )
    # one chart, no layers: Streamlit squeezes a layered chart on an ordinal axis into one line
    return (
        base.mark_rect()
        .encode(
            color=alt.Color(
                "relative_error:Q",
                scale=alt.Scale(type="log", scheme="viridis"),
                legend=alt.Legend(title="relative error", format=".0e"),
            ),
            stroke=alt.Stroke(
                "outline:N",
                scale=alt.Scale(domain=list(OUTLINES), range=list(OUTLINES.values())),
                legend=None,  # the page says in words what each outline means
            ),
            # the test reads booleans: a label with an apostrophe inside a Vega expression string breaks it
            strokeWidth=alt.condition(alt.datum.flipped | alt.datum.beyond, alt.value(2), alt.value(0)),
        )
        .properties(title=title)
    )


def line_chart(df: pd.DataFrame, title: str) -> Any:
    import altair as alt

    return (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=alt.X("layer:O", title="layer", axis=alt.Axis(labelAngle=0)),
            y=alt.Y(
                "median_relative_error:Q", title="median relative error", scale=alt.Scale(type="log"), axis=alt.Axis(format=".0e")
            ),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom")),
            tooltip=["layer", "series", alt.Tooltip("median_relative_error:Q", title="median relative error", format=".2e")],
        )
        .properties(title=title)
    )


def block_choices(p: dict[str, Any]) -> dict[str, str]:
    """The blocks a page offers, in words (an MoE model's MLP is its MoE block)."""
    moe = bool(p.get("moe_layers"))
    return {b: ("MLP or MoE block" if b == "mlp" and moe else block_words(b, -1, [])) for b in p["blocks"]}
