"""HTML for the token heat view, shared by the dashboard and the self-contained report.

Tokens are untrusted text: every piece and tooltip goes through html.escape(..., quote=True).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from logprob_parity.analysis.verdict import LEVEL_WORDS, RATIO_BANDS
from logprob_parity.present.palette import LEVEL_COLOURS, dtype_colour
from logprob_parity.results.bands import DTYPE_EPS, VLLM_TEST_TOL, band_of
from logprob_parity.results.run import Run, SequenceResult


@dataclass(frozen=True)
class Scale:
    """A raw colour scale: light to dark along the values, clamped at both ends."""

    key: str
    label: str
    lo: float
    hi: float
    log: bool

    def position(self, value: float) -> float:
        """0..1 along the clamped colour scale."""
        if not math.isfinite(value):
            return 0.0
        if self.log:
            if value <= self.lo:
                return 0.0
            return min(1.0, (math.log10(value) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo)))
        return min(1.0, max(0.0, (value - self.lo) / (self.hi - self.lo)))

    def with_hi(self, hi: float) -> Scale:
        return Scale(self.key, self.label, min(self.lo, hi / 10), hi, self.log)

    def rgb(self, value: float) -> tuple[int, int, int]:
        return colour(self.position(value))

    def dark(self, value: float) -> bool:
        return self.position(value) > 0.7


SCALES = {
    "abs_delta": Scale("abs_delta", "|Δ logp| (nats)", 1e-5, 1e-1, True),
    "prob_delta": Scale("prob_delta", "|Δp|", 1e-6, 1e-2, True),
    "kl_topk": Scale("kl_topk", "top-k KL (nats)", 1e-8, 1e-2, True),
    "rank_change": Scale("rank_change", "|rank change|", 0.0, 10.0, False),
    # an MoE model's tokens: how many of its MoE layers picked other experts in vLLM than in HF
    "routing_layers_flipped": Scale("routing_layers_flipped", "MoE layers routed differently", 0.0, 4.0, False),
}
ROUTING_METRIC = "routing_layers_flipped"
# OrRd, light to dark
_STOPS = [(255, 247, 236), (253, 212, 158), (252, 141, 89), (215, 48, 31), (127, 0, 0)]

NEUTRAL, AMBER_LO, AMBER_HI, ORANGE = (241, 245, 249), (253, 248, 228), (251, 191, 36), (249, 115, 22)
RED_LO, RED_HI = (239, 68, 68), (127, 29, 29)


@dataclass(frozen=True)
class MeaningScale:
    """|Δ logp| coloured by what it means, in the three bands of logprob_parity.results.bands, which
    never overlap, so colour, the data's `band` and the verdict tell one story:
    1. `noise`: within the tail of HF's own per-token noise (its 99.5th percentile): neutral, whatever the
       tolerance (the tail lies above it in bfloat16);
    2. `tolerance`: beyond that tail but within vLLM's test tolerance: pale to amber up to the tight
       tolerance, then orange up to the loose one;
    3. `beyond`: beyond both: red, darkest at a 5x probability ratio."""

    limit: float  # where a token leaves HF's noise (results.bands.noise_limit)
    source: str  # "tail" (measured), "max" (a run stored before the tail: HF's largest move) or "unmeasured"
    key: str = "abs_delta"
    label: str = "|Δ logp|, by what it means"
    words: str | None = None  # the tail in words ("HF moved 99.5% of 480 tokens by at most 0.11 against itself")

    def band(self, value: float) -> str:
        """'noise', 'tolerance' or 'beyond': the band a gap falls in (unscored: 'noise')."""
        return band_of(value, self.limit) or "noise"

    def rgb(self, value: float) -> tuple[int, int, int]:
        tight, loose = VLLM_TEST_TOL
        band = self.band(value)
        if band == "noise":
            return NEUTRAL
        if band == "beyond":
            return _mix(RED_LO, RED_HI, _log_share(value, max(loose, self.limit), math.log(RATIO_BANDS[1])))
        if value > tight:
            return ORANGE
        return _mix(AMBER_LO, AMBER_HI, _log_share(value, self.limit, tight)) if self.limit > 0 else AMBER_LO

    def dark(self, value: float) -> bool:
        return self.band(value) == "beyond"

    @property
    def red_from(self) -> float:
        """The smallest gap drawn red: beyond both the noise's tail and the loose tolerance."""
        return max(self.limit, VLLM_TEST_TOL[1])


def meaning_scale(dtype: str, limit: float | None = None, words: str | None = None, source: str = "tail") -> MeaningScale:
    """The meaning scale of one dtype's row: where a token leaves HF's measured noise (its tail; 0
    included: HF gave identical values), else one rounding step stands in and the legend says the
    noise is not measured."""
    if limit is not None:
        return MeaningScale(float(limit), source, words=words)
    return MeaningScale(DTYPE_EPS.get(dtype, 2.0**-23), "unmeasured")


def _log_share(v: float, lo: float, hi: float) -> float:
    if hi <= lo:
        return 1.0
    return max(0.0, min(1.0, (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))))


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], f: float) -> tuple[int, int, int]:
    return tuple(round(a[j] + (b[j] - a[j]) * f) for j in range(3))  # type: ignore[return-value]


CSS = """
.lpp-tv{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:14px;line-height:1.9}
.lpp-row{display:flex;gap:.8em;align-items:flex-start;margin:.3em 0;border-bottom:1px solid #eee}
.lpp-label{flex:0 0 6.5em;font-weight:600;color:#444;padding-top:.1em}
.lpp-swatch{display:inline-block;width:.7em;height:.7em;border-radius:2px;margin-right:.35em}
.lpp-text{white-space:pre-wrap;word-break:break-word;flex:1}
.lpp-tok{border-radius:3px;padding:0 1px;cursor:default}
.lpp-tok:hover{box-shadow:0 0 0 2px #111827}
.lpp-tok.lpp-over{outline:2px solid #1d4ed8;outline-offset:-1px}
.lpp-tok.lpp-unscored{background:repeating-linear-gradient(45deg,#f3f4f6,#f3f4f6 3px,#e5e7eb 3px,#e5e7eb 6px);color:#6b7280}
.lpp-tok.lpp-special{color:#6b21a8;font-style:italic}
.lpp-tok.lpp-partial::before{content:"◌";color:#6b7280}
.lpp-nl{color:#9ca3af}
.lpp-tip{display:none;position:fixed;z-index:1000;right:12px;bottom:12px;width:min(46em,calc(100vw - 24px));
 max-height:calc(100vh - 24px);overflow:hidden;background:#111827;color:#f9fafb;padding:.6em .8em;border-radius:8px;
 font-size:12px;line-height:1.5;white-space:pre-wrap;overflow-wrap:anywhere;pointer-events:none;
 box-shadow:0 6px 20px rgba(0,0,0,.35);font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.lpp-tok:hover .lpp-tip{display:block}
.lpp-legend{display:flex;flex-wrap:wrap;align-items:center;gap:.5em .9em;font:12px system-ui,sans-serif;margin:.4em 0 .8em}
.lpp-bar{width:16em;height:.9em;border-radius:3px;border:1px solid #ddd}
.lpp-key{display:inline-flex;align-items:center;gap:.3em}
.lpp-chip{display:inline-block;width:1.4em;height:.9em;border-radius:3px;border:1px solid #d1d5db}
"""
# The tooltip is a panel fixed to the viewport's lower right: every value stays readable wherever
# the token is (no clipping at the page edge), and pointer-events:none closes it as the mouse leaves.


def colour(pos: float) -> tuple[int, int, int]:
    x = max(0.0, min(1.0, pos)) * (len(_STOPS) - 1)
    i = min(int(x), len(_STOPS) - 2)
    return _mix(_STOPS[i], _STOPS[i + 1], x - i)


def metric_values(seq: SequenceResult, key: str) -> np.ndarray:
    m = seq.metrics
    if key == "rank_change":
        return np.where(m.scored, np.abs(seq.vllm.rank - seq.hf.rank).astype(float), np.nan)
    if key == ROUTING_METRIC:  # per token, the first token included: it is routed too
        got = (seq.routing or {}).get("flipped")
        return np.asarray(got, dtype=np.float64) if got is not None else np.full(len(seq.token_ids), np.nan)
    return getattr(m, key)


def _fmt_lp(x: float) -> str:
    return f"{x:+.9f}" if math.isfinite(x) else "n/a"


def _topk_lines(side: str, seq: SequenceResult, t: int, n: int = 5) -> str:
    sc = getattr(seq, side)
    texts = seq.topk_text[side][t] if seq.topk_text else [str(i) for i in sc.topk_ids[t]]
    # each candidate with its id: two candidates whose text reads alike are still told apart
    parts = [
        f"{texts[j]!r} #{int(sc.topk_ids[t, j])} {sc.topk_logprobs[t, j]:.4f}"
        for j in range(min(n, sc.topk_ids.shape[1]))
        if sc.topk_ids[t, j] >= 0
    ]
    return "   ".join(parts)


def tooltip(seq: SequenceResult, t: int, layers: dict[str, Any] | None = None) -> str:
    """Plain text; escaped by the caller. layers: a layer part on this very text (a diagnosis's), whose
    line says where in the network this token first left HF's noise."""
    m = seq.metrics
    shown = seq.pieces[t]
    what = repr(shown) if shown != "" else "part of a character that a later token completes"
    head = f"#{t}  {what}  id {seq.token_ids[t]}"
    routes = _routing_lines(seq, t) + _layer_lines(layers, t)
    if not m.scored[t]:
        return "\n".join([head + "\nnot scored (no prediction for the first position)", *routes])
    hf, vl = seq.hf, seq.vllm
    lines = [
        head,
        f"HF    logprob {_fmt_lp(hf.logprob[t])}  p {math.exp(hf.logprob[t]):.6g}  rank {hf.rank[t]}",
        f"vLLM  logprob {_fmt_lp(vl.logprob[t])}  p {math.exp(vl.logprob[t]):.6g}  rank {vl.rank[t]}",
        f"Δ logp {m.delta[t]:+.3e}   |Δp| {m.prob_delta[t]:.3e}   top-k KL {m.kl_topk[t]:.3e}",
        "most likely next token: " + ("the same in both" if m.argmax_agree[t] else "DIFFERENT between the engines"),
        "HF top-5:   " + _topk_lines("hf", seq, t),
        "vLLM top-5: " + _topk_lines("vllm", seq, t),
        *routes,
    ]
    return "\n".join(lines)


def _layer_lines(prof: dict[str, Any] | None, t: int) -> list[str]:
    """Where in the network token t first left HF's own noise (logprob_parity.analysis.layers), from a
    diagnosis's layer part on this text; nothing without one."""
    if not prof or "first_beyond" not in prof or t >= len(prof["first_beyond"]):
        return []
    from logprob_parity.analysis.layers import block_words

    k = prof["first_beyond"][t]
    if k is None:
        return ["where in the network: within HF's own noise at every layer (Diagnostics)"]
    r = prof["per_layer"][k]
    return [
        f"where in the network: first beyond HF's noise at layer {r['layer']}'s "
        f"{block_words(r['block'], r['layer'], prof['moe_layers'])} (Diagnostics)"
    ]


def _routing_lines(seq: SequenceResult, t: int) -> list[str]:
    """An MoE model's routing of token t: the same experts in every layer, or each layer that differs
    with both engines' expert sets (logprob_parity.engines.routing)."""
    r = seq.routing
    if not r or t >= len(r.get("flipped", ())):
        return []
    from logprob_parity.engines.routing import flips_at

    flips = flips_at(r, t)
    if not flips:
        return [f"experts: the same in all {r['layers']} MoE layers"]
    return [f"experts: DIFFERENT in {len(flips)} of {r['layers']} MoE layers"] + [
        f"  layer {layer}: vLLM {v}  HF {h}" for layer, v, h in flips
    ]


def _piece_html(seq: SequenceResult, t: int) -> tuple[str, bool]:
    """The text this token adds, as the reader wrote it (emoji, Arabic, Hebrew, CJK included), never
    the tokenizer's byte-level spelling. A token that holds only part of a character adds no text:
    it is drawn as a marker (CSS, so the page's text still reads back as the input) and stays hoverable."""
    piece = seq.pieces[t]
    special = seq.bos_added and t == 0
    out = html.escape(piece, quote=True)
    out = out.replace("\n", '<span class="lpp-nl">↵</span>\n')
    return out, special


def sequence_row_html(
    label: str,
    seq: SequenceResult,
    scale: Scale | MeaningScale,
    threshold: float | None,
    start: int = 0,
    stop: int | None = None,
    layers: dict[str, Any] | None = None,
) -> str:
    """One row of tokens [start, stop) coloured by `scale` (a long text is shown a window at a time);
    `layers`: this text's layer part, named in each token's hover."""
    vals = metric_values(seq, scale.key)
    stop = len(seq.token_ids) if stop is None else min(stop, len(seq.token_ids))
    spans = []
    for t in range(start, stop):
        piece, special = _piece_html(seq, t)
        classes = ["lpp-tok"]
        style = ""
        v = float(vals[t])
        if not seq.metrics.scored[t]:
            classes.append("lpp-unscored")
        else:
            r, g, b = scale.rgb(v)
            style = f"background:rgb({r},{g},{b});color:{'#fff' if scale.dark(v) else '#111'}"
            if threshold is not None and v > threshold:
                classes.append("lpp-over")
        if special:
            classes.append("lpp-special")
        if piece == "":
            classes.append("lpp-partial")
        tip = html.escape(tooltip(seq, t, layers), quote=True)
        data = f' data-index="{t}" data-value="{v!r}"' if math.isfinite(v) else f' data-index="{t}"'
        spans.append(f'<span class="{" ".join(classes)}" style="{style}"{data}>{piece}<span class="lpp-tip">{tip}</span></span>')
    swatch = f'<span class="lpp-swatch" style="background:{dtype_colour(label)}"></span>'
    return (
        f'<div class="lpp-row"><div class="lpp-label">{swatch}{html.escape(label, quote=True)}</div>'
        f'<div class="lpp-text">{"".join(spans)}</div></div>'
    )


def _chip(rgb: tuple[int, int, int]) -> str:
    return f'<span class="lpp-chip" style="background:rgb{rgb}"></span>'


def legend_html(scale: Scale, threshold: float | None) -> str:
    grad = ",".join(f"rgb{c}" for c in _STOPS)
    lo = f"≤{scale.lo:.0e}" if scale.log else f"{scale.lo:g}"
    hi = f"≥{scale.hi:.0e}" if scale.log else f"≥{scale.hi:g}"
    thr = f" · outlined: &gt; {threshold:.3g}" if threshold is not None else ""
    kind = "log scale" if scale.log else "linear"
    return (
        f'<div class="lpp-legend"><b>{html.escape(scale.label)}</b><span>{lo}</span>'
        f'<span class="lpp-bar" style="background:linear-gradient(90deg,{grad})"></span><span>{hi}</span>'
        f"<span>(raw {kind}, clamped){thr}</span></div>"
    )


def meaning_legend_html(floors: dict[str, MeaningScale], threshold: float | None) -> str:
    """The meaning scale's key: its three bands in order, with where each row's noise ends in words and
    numbers (the tail, on how many tokens, or not measured), and where red starts and why."""
    tight, loose = VLLM_TEST_TOL

    def noise_words(d: str, s: MeaningScale) -> str:
        if s.source == "unmeasured":
            return (
                f"{html.escape(d)}: HF’s own noise is not measured (run with its noise floor, or Diagnostics); "
                f"one rounding step, {s.limit:.1e}, stands in"
            )
        if s.limit == 0:
            return f"{html.escape(d)}: 0 (HF gave identical values against itself)"
        said = html.escape(s.words) if s.words else "HF’s measured noise"
        return f"{html.escape(d)} ≤ {s.limit:.2g} ({said})"

    noise_txt = "; ".join(noise_words(d, s) for d, s in floors.items())
    red = "; ".join(
        f"{html.escape(d)}: red from {s.red_from:.2g}"
        + (
            f", HF’s own noise, which lies above vLLM’s tolerance of {loose:g}: a token within it is noise, not a problem"
            if s.limit > loose
            else f", vLLM’s loose tolerance, which lies above HF’s own noise ({s.limit:.2g})"
        )
        for d, s in floors.items()
    )
    thr = f'<span class="lpp-key">outlined: |Δ logp| &gt; {threshold:.3g}</span>' if threshold is not None else ""
    return (
        '<div class="lpp-legend" data-scale="meaning"><b>Colour: how far apart the engines are</b>'
        f'<span class="lpp-key" data-band="noise">{_chip(NEUTRAL)} within HF’s own noise, the gap HF makes to '
        f"itself at 199 of 200 tokens: {noise_txt}</span>"
        f'<span class="lpp-key" data-band="tolerance">{_chip(AMBER_LO)}{_chip(AMBER_HI)}{_chip(ORANGE)} beyond HF’s noise, '
        f"within vLLM’s test tolerance (≤ {tight:g}, orange to the loose {loose:g})</span>"
        f'<span class="lpp-key" data-band="beyond">{_chip(RED_LO)}{_chip(RED_HI)} beyond both HF’s noise and vLLM’s '
        f"tolerance: a problem. Noise alone puts about 1 token in 200 here, so a few are expected; "
        f'the verdict says whether there are more</span><span class="lpp-key lpp-note lpp-red-from">{red}.</span>{thr}</div>'
    )


def token_view_html(
    runs: list[Run],
    seq_index: int,
    metric: str = "abs_delta",
    threshold: float | None = None,
    scale_hi: float | None = None,
    *,
    raw: bool = False,
    floors: dict[str, float] | None = None,
    window: tuple[int, int] | None = None,
    floor_words: dict[str, str] | None = None,
    layers: dict[str, dict[str, Any]] | None = None,
) -> str:
    """One row per dtype for one sequence, with the CSS inline (st.html and reports alike).

    |Δ logp| is coloured by meaning (HF's noise tail, vLLM's tolerance) unless `raw`; `floors` are where
    each dtype's tokens leave HF's measured noise (its tail: verdict.hf_noise_of, the verdict's own),
    `floor_words` that tail in words; a dtype without one says it is not measured, and one rounding
    step stands in. `window` shows positions [start, stop) only, so a long text stays fast. `layers`: a
    diagnosis's layer part per dtype; on the text it captured, each token's hover says where in the
    network it first left HF's noise."""
    start, stop = window if window else (0, None)
    live = [r for r in runs if seq_index < len(r.sequences)]
    here = {d: prof for d, prof in (layers or {}).items() if prof.get("text", 0) == seq_index and "first_beyond" in prof}
    if metric == "abs_delta" and not raw:
        scales = {r.dtype: meaning_scale(r.dtype, (floors or {}).get(r.dtype), (floor_words or {}).get(r.dtype)) for r in live}
        legend = meaning_legend_html(scales, threshold)
        rows = [
            sequence_row_html(r.dtype, r.sequences[seq_index], scales[r.dtype], threshold, start, stop, here.get(r.dtype))
            for r in live
        ]
    else:
        scale = SCALES[metric]
        if scale_hi is not None:
            scale = scale.with_hi(scale_hi)
        legend = legend_html(scale, threshold)
        rows = [
            sequence_row_html(r.dtype, r.sequences[seq_index], scale, threshold, start, stop, here.get(r.dtype)) for r in live
        ]
    return f'<style>{CSS}</style><div class="lpp-tv">{legend}{"".join(rows)}</div>'


def windows(runs: list[Run], seq_index: int, size: int) -> list[tuple[int, int, float]]:
    """A long sequence cut into windows of `size` positions, worst first: (start, stop, largest |Δ logp|)."""
    seqs = [r.sequences[seq_index] for r in runs]
    n = min(len(s.token_ids) for s in seqs)
    out = []
    for start in range(0, n, size):
        stop = min(start + size, n)
        worst = max(
            (float(np.nanmax(np.where(s.metrics.scored[start:stop], s.metrics.abs_delta[start:stop], -np.inf))) for s in seqs),
            default=0.0,
        )
        out.append((start, stop, worst if math.isfinite(worst) else 0.0))
    return sorted(out, key=lambda w: -w[2])


def verdict_html(verdicts: list[dict]) -> str:
    """Verdict cards (from logprob_parity.analysis.verdict) for reports, in the dashboard's level colours."""
    cards = []
    for v in verdicts:
        bg, fg = LEVEL_COLOURS.get(v["level"], ("#f3f4f6", "#111827"))
        items = "".join(f"<li>{html.escape(r, quote=True)}</li>" for r in v["reasons"])
        title = html.escape(LEVEL_WORDS.get(v["level"], v["level"]), quote=True)
        cards.append(
            f'<div style="background:{bg};color:{fg};border-radius:8px;padding:.6em 1em;margin:.5em 0" data-level="{html.escape(v["level"])}">'
            f"<b>{title}.</b> <b>{html.escape(v['headline'], quote=True)}</b><ul>{items}</ul></div>"
        )
    if verdicts:
        th = "; ".join(html.escape(t, quote=True) for t in verdicts[0]["thresholds"])
        cards.append(f'<p style="font-size:12px;color:#555">Thresholds: {th}</p>')
    return "".join(cards)
