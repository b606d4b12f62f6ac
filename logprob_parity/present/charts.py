"""Altair charts of one or more runs (one colour per dtype); the dashboard shows them, reports embed them."""

from __future__ import annotations

from typing import Any

import pandas as pd

from logprob_parity.present.palette import dtype_color_encoding
from logprob_parity.results.run import Run

FLOOR = 1e-10  # |Δ| of exactly 0 drawn here on log axes


COLUMNS = [
    "seq",
    "index",
    "token_id",
    "piece",
    "hf_logprob",
    "vllm_logprob",
    "delta",
    "abs_delta",
    "hf_prob",
    "prob_delta",
    "kl_topk",
]
# A chart of every position of a large prompt set would be millions of marks: past this many rows a
# run's chart shows its largest gaps and an even sample of the rest (thinned() says how many).
MAX_CHART_ROWS = 20_000


def chart_frame(runs: list[Run], seq_index: int | None = None, max_rows: int | None = MAX_CHART_ROWS) -> pd.DataFrame:
    """Scored positions of the runs (one sequence, or all), with a dtype column. Over all sequences
    only the scalar columns are read (never the top-k lists), and a run past max_rows keeps its
    max_rows // 10 largest gaps plus an even sample of the rest (attrs["thinned"] counts them)."""
    frames, thinned = [], {}
    for r in runs:
        if seq_index is not None:
            df = r.sequences[seq_index].to_frame().assign(seq=seq_index)
        else:
            df = r.column_frame([c for c in COLUMNS if c != "seq"] + ["scored"])
        df = df[df["scored"]]
        if max_rows is not None and len(df) > max_rows:
            worst = df.nlargest(max_rows // 10, "abs_delta")
            rest = df.drop(worst.index)
            step = max(1, len(rest) // (max_rows - len(worst)))
            thinned[r.dtype] = len(df)
            df = pd.concat([worst, rest.iloc[::step]]).sort_index()
        frames.append(
            df[COLUMNS].assign(
                dtype=r.dtype,
                abs_delta_plot=lambda d: d["abs_delta"].clip(lower=FLOOR),
                prompt_no=lambda d: d["seq"] + 1,  # the prompt as people number it
            )
        )
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.attrs["thinned"] = thinned
    return out


def _tooltip() -> list[Any]:
    import altair as alt

    return [
        alt.Tooltip("dtype:N"),
        alt.Tooltip("prompt_no:Q", title="prompt"),
        alt.Tooltip("index:Q", title="position"),
        alt.Tooltip("piece:N", title="token"),
        alt.Tooltip("hf_logprob:Q", title="HF logprob", format=".9f"),
        alt.Tooltip("vllm_logprob:Q", title="vLLM logprob", format=".9f"),
        alt.Tooltip("delta:Q", title="Δ logp", format=".3e"),
    ]


def histogram(df: pd.DataFrame) -> Any:
    import altair as alt

    return (
        alt.Chart(df, title="How big the gaps are: tokens per size of gap")
        .transform_calculate(log_abs="log(datum.abs_delta_plot) / LN10")
        .mark_bar(opacity=0.55, binSpacing=0)
        .encode(
            x=alt.X(
                "log_abs:Q",
                bin=alt.Bin(maxbins=40),
                title="gap between the engines, |Δ logp| (log scale)",
                axis=alt.Axis(labelExpr="format(pow(10, datum.value), '.0e')"),
            ),
            y=alt.Y("count():Q", stack=None, title="tokens"),
            color=dtype_color_encoding(df["dtype"]),
        )
    )


def scatter(df: pd.DataFrame) -> Any:
    import altair as alt

    lo = float(min(df["hf_logprob"].min(), df["vllm_logprob"].min())) if len(df) else -10.0
    diag = alt.Chart(pd.DataFrame({"x": [lo, 0.0]})).mark_line(color="#999", strokeDash=[4, 4]).encode(x="x:Q", y="x:Q")
    pts = (
        alt.Chart(df, title="vLLM against HF: each dot a token; on the dashed line they agree")
        .mark_circle(size=45, opacity=0.7)
        .encode(
            x=alt.X("hf_logprob:Q", title="HF log probability of the token"),
            y=alt.Y("vllm_logprob:Q", title="vLLM log probability of the token"),
            color=dtype_color_encoding(df["dtype"]),
            tooltip=_tooltip(),
        )
    )
    return diag + pts


def by_position(df: pd.DataFrame, floors: dict[str, float] | None = None) -> Any:
    """floors: HF's own noise floor per dtype (logprob_parity.analysis.floors: the verdict's), drawn as a dashed line."""
    import altair as alt

    line = (
        alt.Chart(df, title="Gap along the text" + (" (dashed: HF's own noise floor)" if floors else ""))
        .mark_line(point=True)
        .encode(
            x=alt.X("index:Q", title="position in the text (token number)"),
            y=alt.Y("abs_delta_plot:Q", scale=alt.Scale(type="log"), title="gap, |Δ logp| (log scale)"),
            color=dtype_color_encoding(df["dtype"]),
            detail="seq:N",
            tooltip=_tooltip(),
        )
    )
    if not floors:
        return line
    band = pd.DataFrame([{"dtype": d, "floor": max(f, FLOOR)} for d, f in floors.items()])
    rule = (
        alt.Chart(band)
        .mark_rule(strokeDash=[6, 4], size=2)
        .encode(
            y="floor:Q",
            color=dtype_color_encoding(df["dtype"]),
            tooltip=[alt.Tooltip("dtype:N"), alt.Tooltip("floor:Q", title="HF noise floor", format=".3e")],
        )
    )
    return line + rule


def by_probability(df: pd.DataFrame) -> Any:
    import altair as alt

    return (
        alt.Chart(df, title="Gap against how likely the token was: rare tokens usually differ more")
        .mark_circle(size=45, opacity=0.7)
        .encode(
            x=alt.X("hf_prob:Q", scale=alt.Scale(type="log"), title="HF probability of the token"),
            y=alt.Y("abs_delta_plot:Q", scale=alt.Scale(type="log"), title="gap, |Δ logp| (log scale)"),
            color=dtype_color_encoding(df["dtype"]),
            tooltip=_tooltip(),
        )
    )


CHARTS = {"histogram": histogram, "scatter": scatter, "by_position": by_position, "by_probability": by_probability}


def worst_tokens(runs: list[Run], n: int = 20, seq_index: int | None = None) -> pd.DataFrame:
    """The n largest gaps of one sequence, or of every sequence (found from the gap column alone,
    then only those positions read in full)."""
    if seq_index is None:
        rows = []
        for r in runs:
            f = r.column_frame(["index", "abs_delta", "scored"])
            for seq, index in f[f["scored"]].nlargest(n, "abs_delta")[["seq", "index"]].itertuples(index=False):
                s = r.sequences[int(seq)]
                m = s.metrics
                rows.append(
                    {
                        "seq": int(seq),
                        "index": int(index),
                        "token_id": s.token_ids[index],
                        "piece": s.pieces[index],
                        "hf_logprob": s.hf.logprob[index],
                        "vllm_logprob": s.vllm.logprob[index],
                        "delta": m.delta[index],
                        "abs_delta": m.abs_delta[index],
                        "hf_prob": m.hf_prob[index],
                        "prob_delta": m.prob_delta[index],
                        "kl_topk": m.kl_topk[index],
                        "dtype": r.dtype,
                    }
                )
        df = pd.DataFrame(rows, columns=[*COLUMNS, "dtype"])
    else:
        df = chart_frame(runs, seq_index, max_rows=None)
    if df.empty:
        return df
    cols = [
        "dtype",
        "seq",
        "index",
        "piece",
        "token_id",
        "hf_logprob",
        "vllm_logprob",
        "delta",
        "abs_delta",
        "prob_delta",
        "kl_topk",
    ]
    out = df.nlargest(n, "abs_delta")[cols].rename(columns={"piece": "token", "seq": "prompt", "index": "position"})
    return out.assign(prompt=out["prompt"] + 1)  # people count prompts from 1 (the stored index stays 0-based)
