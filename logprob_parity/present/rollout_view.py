"""Views of a rollout without Streamlit: completions as coloured token text, the ratio strip, the
Δ and ratio histograms with the clip thresholds, the metrics table in words, and the report.

Token text is untrusted: every piece and tooltip is escaped here before any page shows it.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from logprob_parity.present.palette import dtype_colour
from logprob_parity.present.render import CSS, meaning_legend_html, meaning_scale
from logprob_parity.results.offpolicy import MIS_BAND, RATIO_BANDS, TIS_CAP
from logprob_parity.results.rollout import PAIRS, Rollout

# The rollout metrics a reader sees, in words (key -> label, how to show it).
METRIC_WORDS: tuple[tuple[str, str, str], ...] = (
    ("n_tokens", "tokens compared", "d"),
    ("mean_abs_delta", "mean |Δ logp| (TRL sampling_logp_difference, slime abs diff)", "e"),
    ("max_abs_delta", "largest |Δ logp|", "e"),
    ("kl", "KL estimate k1 (verl rollout_corr/kl)", "e"),
    ("k2_kl", "KL estimate k2", "e"),
    ("k3_kl", "KL estimate k3 (verl k3_kl)", "e"),
    ("chi2_token", "χ² per token (verl chi2_token)", "e"),
    ("chi2_seq", "χ² per sequence (verl chi2_seq)", "e"),
    ("rollout_is_mean", "importance ratio, mean", "f"),
    ("rollout_is_min", "importance ratio, smallest", "f"),
    ("rollout_is_max", "importance ratio, largest", "f"),
    ("rollout_is_eff_sample_size", "effective sample size (share of tokens)", "%"),
    ("frac_ratio_outside_0.8_1.25", "tokens with ratio outside 0.8–1.25", "%"),
    ("frac_ratio_outside_0.5_2", "tokens with ratio outside 0.5–2", "%"),
    ("seq_log_ratio_mean", "sequence log-ratio, mean", "e"),
    ("seq_log_ratio_max", "sequence log-ratio, largest", "e"),
    ("ppl_ratio", "perplexity ratio, trainer / rollout (verl ppl_ratio)", "f"),
    ("token_mult_prob_error", "token_mult_prob_error (NeMo-RL; 1 is perfect)", "f"),
    ("tis_clip_fraction", "clipped by TIS (ratio above the cap)", "%"),
    ("mis_mask_fraction", "masked by MIS/IcePop (ratio outside the band)", "%"),
    ("dp_rms", "RMS Δp (llama.cpp)", "e"),
    # llama.cpp's full-distribution statistics: prefill vs HF only (a decode keeps one token's logprob)
    ("kl_full_mean", "exact KL over the whole vocabulary, mean (llama.cpp)", "e"),
    ("kl_full_mean_err", "exact KL, ± standard error of the mean", "e"),
    ("kl_full_p99", "exact KL, 99th percentile", "e"),
    ("kl_full_max", "exact KL, largest", "e"),
    ("same_top_p", "same most likely token (llama.cpp same top p)", "%"),
)


def fmt(value: Any, kind: str) -> str:
    """Display only; stored values keep full precision."""
    if value is None:
        return "–"
    if kind == "d":
        return f"{int(value):,}"
    if kind == "%":
        return f"{value:.2%}"
    if kind == "f":
        return f"{value:.6g}"
    return f"{value:.3e}"


def shown_pairs(ro: Rollout) -> list[str]:
    """The pairs that say something: the processed pair only when processing changed the values."""
    return [p for p in PAIRS if p != "processed_vs_trainer" or ro.meta.processed.startswith("vLLM's own")]


SHORT = {
    "decode_vs_hf": "decode vs HF",
    "decode_vs_prefill": "decode vs prefill",
    "prefill_vs_hf": "prefill vs HF",
    "processed_vs_trainer": "processed vs trainer",
}


def metrics_table(ro: Rollout) -> pd.DataFrame:
    """Rows: metrics in words; columns: the pairs (Δ = the first side − the second)."""
    pairs = shown_pairs(ro)
    rows = []
    for key, label, kind in METRIC_WORDS:
        rows.append({"metric": label, **{SHORT[p]: fmt(ro.meta.summary[p].get(key), kind) for p in pairs}})
    return pd.DataFrame(rows)


def floors_table(ro: Rollout) -> pd.DataFrame:
    rows = []
    for _name, f in ro.meta.floors.items():
        rows.append(
            {
                "what changes": f["what"],
                "mean |Δ logp|": fmt(f.get("mean"), "e"),
                "largest": fmt(f.get("max"), "e"),
                "tokens": fmt(f.get("n"), "d"),
                "same tokens": f"{f['same_tokens']} of {f['of']}" if "same_tokens" in f else "",
                "in HF's floor": "yes" if f.get("in_floor") else "",
            }
        )
    return pd.DataFrame(rows)


def _routing_tip(ro: Rollout, i: int, t: int) -> list[str]:
    """The MoE layers that routed completion token t's decode step differently, with both sets."""
    info = ro.meta.samples[i] if i < len(ro.meta.samples) else {}
    r = info.get("routing") if isinstance(info, dict) else None
    if not r:
        return []
    got = [f for f in r.get("flips", ()) if f[0] == t]
    if not got:
        return [f"MoE routing: the same experts in all {r['layers']} layers (decode and HF)"]
    return [f"MoE routing DIFFERENT in {len(got)} of {r['layers']} layers:"] + [
        f"  layer {layer}: vLLM {v}  HF {h}" for _t, layer, v, h in got
    ]


def _tip(ro: Rollout, i: int, t: int) -> str:
    s = ro.samples[i]
    lp = {c: float(s.logprob[c][t]) for c in s.logprob}
    piece = s.pieces[t]
    what = repr(piece) if piece != "" else "part of a character that a later token completes"
    rho = math.exp(-(lp["decode_raw"] - lp["hf"]))
    lines = [
        f"completion token #{t}  {what}  id {s.completion_token_ids[t]}",
        f"vLLM decode (raw)       {lp['decode_raw']:+.9f}",
        f"vLLM decode (processed) {lp['decode_processed']:+.9f}",
        f"vLLM prefill            {lp['prefill']:+.9f}",
        f"HF (trainer)            {lp['hf']:+.9f}",
        f"HF at temperature {ro.meta.sampling.get('temperature', 1):g}    {lp['hf_tempered']:+.9f}",
        f"log(kept mass)          {lp['log_kept_mass']:+.6f}",
        f"decode−HF {lp['decode_raw'] - lp['hf']:+.3e}  decode−prefill {lp['decode_raw'] - lp['prefill']:+.3e}  "
        f"prefill−HF {lp['prefill'] - lp['hf']:+.3e}",
        f"importance ratio HF/decode {rho:.6f}",
        *_routing_tip(ro, i, t),
    ]
    return "\n".join(lines)


def rollout_scale(ro: Rollout) -> Any:
    """The meaning scale of a rollout's tokens: its trainer side's noise tail (results.rollout.hf_tail)."""
    from logprob_parity.results.bands import noise_limit, tail_words
    from logprob_parity.results.rollout import hf_tail

    tail = hf_tail(ro.meta)
    limit, source = noise_limit(tail, ro.dtype)
    return meaning_scale(ro.dtype, None if source == "unmeasured" else limit, tail_words(tail), source)


def completion_html(ro: Rollout, i: int, pair: str = "decode_vs_hf", floor: float | None = None) -> str:
    """One sample: its prompt (plain) and its completion as tokens coloured by |Δ| of `pair` on the
    meaning scale (neutral within HF's noise tail, amber to vLLM's tolerance, red beyond); `floor`: where
    the noise ends, when not the rollout's own tail."""
    s = ro.samples[i]
    scale = rollout_scale(ro) if floor is None else meaning_scale(ro.dtype, floor)
    vals = np.abs(s.delta(pair))
    spans = []
    for t in range(len(s.completion_token_ids)):
        v = float(vals[t])
        r, g, b = scale.rgb(v)
        style = f"background:rgb({r},{g},{b});color:{'#fff' if scale.dark(v) else '#111'}"
        piece = html.escape(s.pieces[t], quote=True).replace("\n", '<span class="lpp-nl">↵</span>\n')
        cls = "lpp-tok" + (" lpp-partial" if s.pieces[t] == "" else "")
        tip = html.escape(_tip(ro, i, t), quote=True)
        spans.append(
            f'<span class="{cls}" style="{style}" data-index="{t}" data-value="{v!r}">{piece}'
            f'<span class="lpp-tip">{tip}</span></span>'
        )
    prompt = html.escape(ro.prompt_of(i), quote=True)
    label = html.escape(f"sample {i + 1}", quote=True)
    stop = {"length": "reached max tokens", "stop": "the model ended it"}.get(s.finish_reason or "", s.finish_reason or "")
    note = html.escape(
        f"seed {s.seed} · {len(s.completion_token_ids)} tokens{' · ' + stop if stop else ''} · grey: the prompt (not compared)",
        quote=True,
    )
    legend = meaning_legend_html({ro.dtype: scale}, None)
    return (
        f'<style>{CSS}</style><div class="lpp-tv" data-pair="{html.escape(pair)}">{legend}'
        f'<div class="lpp-row"><div class="lpp-label">{label}</div><div class="lpp-text">'
        f'<span class="lpp-prompt" style="color:#6b7280">{prompt}</span>{"".join(spans)}</div></div>'
        f'<div style="font-size:12px;color:#6b7280;margin:.2em 0 .6em">{note}</div></div>'
    )


STRIP_SAMPLES = 40  # the ratio strip draws a row a sample: beyond this many, the ones furthest from 1


def token_frame(ro: Rollout, pair: str, samples: Any = None, pieces: bool = True) -> pd.DataFrame:
    """Per completion token of these samples (default: all): sample, position, piece (unless not
    wanted: the histograms need none), Δ of `pair`, |Δ| and the importance ratio ρ = exp(trainer −
    rollout). A few samples' rows come from their arrays; every token's (the histograms) from the
    Δ chunks (Rollout.delta_chunks: a stored rescore's straight from its file's columns)."""
    cols: dict[str, list[Any]] = {"sample": [], "position": [], "piece": [], "delta": []}

    def add(idx: Any, ns: np.ndarray, d: np.ndarray) -> None:
        cols["sample"].append(np.repeat(np.asarray(idx, dtype=np.int64), ns))
        cols["position"].append(np.arange(int(ns.sum()), dtype=np.int64) - np.repeat(np.cumsum(ns) - ns, ns))
        cols["delta"].append(d)

    if samples is None:  # every token, a chunk of Δ at a time (a stored rescore's read from its file)
        for lo, ns, d in ro.delta_chunks(pair):
            add(np.arange(lo, lo + len(ns)), ns, d)
        if pieces:
            cols["piece"] = [p for _, part in ro.chunks() for s in part for p in s.pieces]
    else:
        part = [ro.samples[i] for i in samples]
        ns = np.array([len(s.completion_token_ids) for s in part], dtype=np.int64)
        add(
            list(samples),
            ns,
            np.concatenate([np.asarray(s.delta(pair), dtype=np.float64) for s in part]) if part else np.zeros(0),
        )
        cols["piece"] = [p for s in part for p in s.pieces]
    cat = {
        k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64 if k != "delta" else np.float64)
        for k, v in cols.items()
        if k != "piece"
    }
    d = cat["delta"]
    return pd.DataFrame(
        {
            "sample": cat["sample"],
            "position": cat["position"],
            **({"piece": cols["piece"]} if pieces else {}),
            "delta": d,
            "abs_delta": np.abs(d),
            "ratio": np.exp(np.clip(-d, -20, 20)),
            "abs_delta_plot": np.clip(np.abs(d), 1e-10, None),
        }
    )


def strip_samples(ro: Rollout, worst: pd.DataFrame) -> tuple[list[int], str]:
    """The samples the ratio strip draws, and the words for its title: all of them, or the first
    STRIP_SAMPLES of `worst` (Rollout.worst_sequences: furthest from 1 first), in sample order."""
    n = len(ro.samples)
    if n <= STRIP_SAMPLES:
        return list(range(n)), "Importance ratio per token (trainer / rollout probability)"
    shown = sorted(int(i) for i in worst["sample"].head(STRIP_SAMPLES))
    return (
        shown,
        f"Importance ratio per token, the {STRIP_SAMPLES} of {n:,} sequences furthest from 1 (trainer / rollout probability)",
    )


def ratio_strip(df: pd.DataFrame, title: str = "Importance ratio per token (trainer / rollout probability)") -> Any:
    """One cell per token, coloured by log ρ (blue: the trainer gives it more probability, red: less)."""
    import altair as alt

    lim = float(max(np.log(2.0), np.nanmax(np.abs(np.log(df["ratio"]))) if len(df) else 0.0))
    return (
        alt.Chart(df.assign(log_ratio=np.log(df["ratio"]), sample_no=df["sample"] + 1), title=title)
        .mark_rect()
        .encode(
            x=alt.X("position:O", title="completion token", axis=alt.Axis(labels=False, ticks=False)),
            y=alt.Y("sample_no:O", title="sample", axis=alt.Axis(labelOverlap=False)),
            color=alt.Color("log_ratio:Q", title="log ratio", scale=alt.Scale(scheme="redblue", domain=[-lim, lim])),
            tooltip=[
                alt.Tooltip("sample_no:Q", title="sample"),
                alt.Tooltip("position:Q"),
                alt.Tooltip("piece:N", title="token"),
                alt.Tooltip("ratio:Q", format=".6f"),
                alt.Tooltip("delta:Q", title="Δ logp", format=".3e"),
            ],
        )
        .properties(height=alt.Step(20))
    )


def binned(values: np.ndarray, edges: np.ndarray) -> pd.DataFrame:
    """Tokens per bin [edges[i], edges[i+1]) (the last bin closed): what a histogram draws, counted
    here, so a chart of millions of tokens sends the browser a few dozen rows."""
    counts, _ = np.histogram(values[np.isfinite(values)], bins=edges)
    return pd.DataFrame({"lo": edges[:-1], "hi": edges[1:], "tokens": counts})


def delta_histogram(df: pd.DataFrame, dtype: str) -> Any:
    """Tokens per |Δ logp| on a log scale, in bins of a tenth of a decade or more (at most 40), in the
    dtype's colour. Titles are short with a subtitle, so a narrow column does not cut them."""
    import altair as alt

    x = np.log10(df["abs_delta_plot"].to_numpy(dtype=np.float64))
    lo, hi = (
        (float(np.floor(np.nanmin(x) * 10) / 10), float(np.ceil(np.nanmax(x) * 10) / 10)) if np.isfinite(x).any() else (-1.0, 0.0)
    )
    step = next(s for s in (0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if (hi - lo) / s <= 40)
    edges = np.arange(lo, max(hi, lo + step) + step / 2, step)
    return (
        alt.Chart(binned(x, edges), title=alt.TitleParams(f"How big the gaps are ({dtype})", subtitle="tokens per |Δ logp|"))
        .mark_bar(binSpacing=0, color=dtype_colour(dtype))
        .encode(
            x=alt.X(
                "lo:Q", bin="binned", title="|Δ logp| (log scale)", axis=alt.Axis(labelExpr="format(pow(10, datum.value), '.0e')")
            ),
            x2="hi:Q",
            y=alt.Y("tokens:Q", title="tokens", axis=alt.Axis(tickMinStep=1)),
            tooltip=[alt.Tooltip("tokens:Q")],
        )
    )


def ratio_histogram(df: pd.DataFrame, dtype: str, tis_cap: float = TIS_CAP, mis_band: tuple[float, float] = MIS_BAND) -> Any:
    """Tokens per importance ratio (60 bins), with the thresholds drawn: the 0.8–1.25 band, the
    MIS/IcePop band and the TIS cap."""
    import altair as alt

    marks = pd.DataFrame(
        [
            {"x": RATIO_BANDS[0][0], "what": "0.8–1.25 band"},
            {"x": RATIO_BANDS[0][1], "what": "0.8–1.25 band"},
            {"x": mis_band[0], "what": f"MIS band {mis_band[0]:g}–{mis_band[1]:g}"},
            {"x": mis_band[1], "what": f"MIS band {mis_band[0]:g}–{mis_band[1]:g}"},
            {"x": tis_cap, "what": f"TIS cap {tis_cap:g}"},
        ]
    )
    lo = float(min(df["ratio"].min() if len(df) else 1.0, mis_band[0]) * 0.95)
    hi = float(max(df["ratio"].max() if len(df) else 1.0, tis_cap) * 1.05)
    bars = (
        alt.Chart(binned(df["ratio"].to_numpy(dtype=np.float64), np.linspace(lo, hi, 61)))
        .mark_bar(binSpacing=0, color=dtype_colour(dtype))
        .encode(
            x=alt.X("lo:Q", bin="binned", title="importance ratio (trainer / rollout)", scale=alt.Scale(domain=[lo, hi])),
            x2="hi:Q",
            y=alt.Y("tokens:Q", title="tokens", axis=alt.Axis(tickMinStep=1)),
            tooltip=[alt.Tooltip("tokens:Q")],
        )
    )
    rules = (
        alt.Chart(marks)
        .mark_rule(strokeDash=[4, 3], strokeWidth=2)
        .encode(x="x:Q", color=alt.Color("what:N", title="thresholds", scale=alt.Scale(range=["#E69F00", "#009E73", "#D55E00"])))
    )
    title = alt.TitleParams(f"Importance ratios ({dtype})", subtitle="the lines: where RL trainers clip or mask tokens")
    return alt.layer(bars, rules, title=title)


def _svg(chart: Any) -> str:
    try:
        import vl_convert as vlc
    except ImportError:
        return "<p>(charts need vl-convert-python)</p>"
    return vlc.vegalite_to_svg(chart.to_json())


def _df_html(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in df.itertuples(index=False)
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def rollout_report_html(ro: Rollout, max_samples: int = 20) -> str:
    from logprob_parity.present.render import verdict_html
    from logprob_parity.present.report import _PAGE_CSS

    m = ro.meta
    df = token_frame(ro, "decode_vs_hf", pieces=False)
    meta_rows = [
        ("rollout", m.rollout_id),
        ("model", m.model),
        ("dtype", m.dtype),
        ("device", m.env.device),
        ("torch / transformers / vLLM", f"{m.env.torch} / {m.env.transformers} / {m.env.vllm}"),
        ("sampling", json.dumps(m.sampling)),
        ("decode_processed", m.processed),
        ("created", m.created),
    ]
    meta = "".join(f"<tr><th class=l>{html.escape(k)}</th><td class=l>{html.escape(str(v))}</td></tr>" for k, v in meta_rows)
    samples = "".join(completion_html(ro, i, "decode_vs_hf") for i in range(min(len(ro.samples), max_samples)))
    charts = "".join(f"<div>{_svg(c)}</div>" for c in (delta_histogram(df, m.dtype), ratio_histogram(df, m.dtype)))
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>logprob-parity rollout {html.escape(m.rollout_id)}</title>"
        f"<style>{_PAGE_CSS}</style></head><body><h1>Rollout: {html.escape(m.model)} · {html.escape(m.dtype)}</h1>"
        f"{verdict_html([m.verdict]) if m.verdict else ''}<table class=meta>{meta}</table>"
        f"<h2>Three-way comparison</h2>{_df_html(metrics_table(ro))}<h2>Noise floors</h2>{_df_html(floors_table(ro))}"
        f"<h2>Completions (coloured by vLLM decode vs HF)</h2>{samples}<h2>Distributions</h2><div class=charts>{charts}</div>"
        "</body></html>"
    )


def write_rollout_report(ro: Rollout, out: Path) -> None:
    """.html (self-contained), .json (the --json shape) or .parquet (the stored table)."""
    from logprob_parity.present.report import write_by_suffix

    write_by_suffix(
        out,
        {
            ".html": lambda tmp: tmp.write_text(rollout_report_html(ro), encoding="utf-8"),
            ".json": lambda tmp: _write_json(ro, tmp),
            ".parquet": lambda tmp: ro.to_frame().to_parquet(tmp, index=False),
        },
    )


def _write_json(ro: Rollout, path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        ro.write_json(f)
