"""HTML for the token heat view, shared by the dashboard and the self-contained report.

Tokens are untrusted text: every piece and tooltip goes through html.escape(..., quote=True).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
import numpy as np

from core.results.run import Run, SequenceResult


@dataclass(frozen=True)
class Scale:
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

    def with_hi(self, hi: float) -> "Scale":
        return Scale(self.key, self.label, min(self.lo, hi / 10), hi, self.log)


SCALES = {
    "abs_delta": Scale("abs_delta", "|Δ logp| (nats)", 1e-5, 1e-1, True),
    "prob_delta": Scale("prob_delta", "|Δp|", 1e-6, 1e-2, True),
    "kl_topk": Scale("kl_topk", "top-k KL (nats)", 1e-8, 1e-2, True),
    "rank_change": Scale("rank_change", "|rank change|", 0.0, 10.0, False),
}
# OrRd, light to dark
_STOPS = [(255, 247, 236), (253, 212, 158), (252, 141, 89), (215, 48, 31), (127, 0, 0)]

CSS = """
.lpp-tv{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:14px;line-height:1.9}
.lpp-row{display:flex;gap:.8em;align-items:flex-start;margin:.3em 0;border-bottom:1px solid #eee}
.lpp-label{flex:0 0 6.5em;font-weight:600;color:#444;padding-top:.1em}
.lpp-text{white-space:pre-wrap;word-break:break-word;flex:1}
.lpp-tok{position:relative;border-radius:3px;padding:0 1px;cursor:default}
.lpp-tok.lpp-over{outline:2px solid #1d4ed8;outline-offset:-1px}
.lpp-tok.lpp-unscored{background:repeating-linear-gradient(45deg,#f3f4f6,#f3f4f6 3px,#e5e7eb 3px,#e5e7eb 6px);color:#6b7280}
.lpp-tok.lpp-special{color:#6b21a8;font-style:italic}
.lpp-tok.lpp-partial::before{content:"◌";color:#6b7280}
.lpp-nl{color:#9ca3af}
.lpp-tip{display:none;position:absolute;z-index:10;left:0;top:1.7em;min-width:26em;max-width:40em;background:#111827;color:#f9fafb;
 padding:.5em .7em;border-radius:6px;font-size:12px;line-height:1.45;white-space:pre;box-shadow:0 4px 14px rgba(0,0,0,.25)}
.lpp-tok:hover .lpp-tip{display:block}
.lpp-legend{display:flex;align-items:center;gap:.6em;font:12px system-ui,sans-serif;margin:.4em 0 .8em}
.lpp-bar{width:16em;height:.9em;border-radius:3px;border:1px solid #ddd}
"""


def colour(pos: float) -> tuple[int, int, int]:
    x = max(0.0, min(1.0, pos)) * (len(_STOPS) - 1)
    i = min(int(x), len(_STOPS) - 2)
    f = x - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return tuple(round(a[j] + (b[j] - a[j]) * f) for j in range(3))  # type: ignore[return-value]


def metric_values(seq: SequenceResult, key: str) -> np.ndarray:
    m = seq.metrics
    if key == "rank_change":
        return np.where(m.scored, np.abs(seq.vllm.rank - seq.hf.rank).astype(float), np.nan)
    return getattr(m, key)


def _fmt_lp(x: float) -> str:
    return f"{x:+.9f}" if math.isfinite(x) else "n/a"


def _topk_line(side: str, seq: SequenceResult, t: int, n: int = 5) -> str:
    sc = getattr(seq, side)
    texts = seq.topk_text[side][t] if seq.topk_text else [str(i) for i in sc.topk_ids[t]]
    parts = [f"{texts[j]!r} {sc.topk_logprobs[t, j]:.4f}" for j in range(min(n, sc.topk_ids.shape[1])) if sc.topk_ids[t, j] >= 0]
    return ", ".join(parts)


def tooltip(seq: SequenceResult, t: int) -> str:
    """Plain text; escaped by the caller."""
    m = seq.metrics
    shown = seq.pieces[t]
    what = repr(shown) if shown != "" else "part of a character that a later token completes"
    head = f"#{t}  {what}  id {seq.token_ids[t]}"
    if not m.scored[t]:
        return head + "\nnot scored (no prediction for the first position)"
    hf, vl = seq.hf, seq.vllm
    lines = [
        head,
        f"HF    logprob {_fmt_lp(hf.logprob[t])}  p {math.exp(hf.logprob[t]):.6g}  rank {hf.rank[t]}",
        f"vLLM  logprob {_fmt_lp(vl.logprob[t])}  p {math.exp(vl.logprob[t]):.6g}  rank {vl.rank[t]}",
        f"Δ logp {m.delta[t]:+.3e}   |Δp| {m.prob_delta[t]:.3e}   top-k KL {m.kl_topk[t]:.3e}",
        f"argmax {'agrees' if m.argmax_agree[t] else 'DIFFERS'}",
        "HF top-5:   " + _topk_line("hf", seq, t),
        "vLLM top-5: " + _topk_line("vllm", seq, t),
    ]
    return "\n".join(lines)


def _piece_html(seq: SequenceResult, t: int) -> tuple[str, bool]:
    """The text this token adds, as the reader wrote it (emoji, Arabic, Hebrew, CJK included), never
    the tokenizer's byte-level spelling. A token that holds only part of a character adds no text:
    it is drawn as a marker (CSS, so the page's text still reads back as the input) and stays hoverable."""
    piece = seq.pieces[t]
    special = seq.bos_added and t == 0
    out = html.escape(piece, quote=True)
    out = out.replace("\n", '<span class="lpp-nl">↵</span>\n')
    return out, special


def sequence_row_html(label: str, seq: SequenceResult, scale: Scale, threshold: float | None) -> str:
    vals = metric_values(seq, scale.key)
    spans = []
    for t in range(len(seq.token_ids)):
        piece, special = _piece_html(seq, t)
        classes = ["lpp-tok"]
        style = ""
        v = float(vals[t])
        if not seq.metrics.scored[t]:
            classes.append("lpp-unscored")
        else:
            r, g, b = colour(scale.position(v))
            fg = "#fff" if scale.position(v) > 0.7 else "#111"
            style = f"background:rgb({r},{g},{b});color:{fg}"
            if threshold is not None and v > threshold:
                classes.append("lpp-over")
        if special:
            classes.append("lpp-special")
        if piece == "":
            classes.append("lpp-partial")
        tip = html.escape(tooltip(seq, t), quote=True)
        data = f' data-index="{t}" data-value="{v!r}"' if math.isfinite(v) else f' data-index="{t}"'
        spans.append(
            f'<span class="{" ".join(classes)}" style="{style}" title="{tip}"{data}>{piece}<span class="lpp-tip">{tip}</span></span>'
        )
    return (
        f'<div class="lpp-row"><div class="lpp-label">{html.escape(label, quote=True)}</div>'
        f'<div class="lpp-text">{"".join(spans)}</div></div>'
    )


def legend_html(scale: Scale, threshold: float | None) -> str:
    grad = ",".join(f"rgb{c}" for c in _STOPS)
    lo = f"≤{scale.lo:.0e}" if scale.log else f"{scale.lo:g}"
    hi = f"≥{scale.hi:.0e}" if scale.log else f"≥{scale.hi:g}"
    thr = f" · outlined: &gt; {threshold:.3g}" if threshold is not None else ""
    kind = "log scale" if scale.log else "linear"
    return (
        f'<div class="lpp-legend"><b>{html.escape(scale.label)}</b><span>{lo}</span>'
        f'<span class="lpp-bar" style="background:linear-gradient(90deg,{grad})"></span><span>{hi}</span>'
        f"<span>({kind}, clamped){thr}</span></div>"
    )


def token_view_html(runs: list[Run], seq_index: int, metric: str = "abs_delta", threshold: float | None = None, scale_hi: float | None = None) -> str:
    """One row per dtype for one sequence, with the CSS inline (st.html and reports alike)."""
    scale = SCALES[metric]
    if scale_hi is not None:
        scale = scale.with_hi(scale_hi)
    rows = [sequence_row_html(r.dtype, r.sequences[seq_index], scale, threshold) for r in runs if seq_index < len(r.sequences)]
    return f"<style>{CSS}</style><div class=\"lpp-tv\">{legend_html(scale, threshold)}{''.join(rows)}</div>"



_LEVEL_COLOURS = {"match": ("#ecfdf5", "#065f46"), "close": ("#fffbeb", "#92400e"), "differs": ("#fef2f2", "#991b1b")}


def verdict_html(verdicts: list[dict]) -> str:
    """Verdict cards (from core.analysis.verdict) for reports."""
    cards = []
    for v in verdicts:
        bg, fg = _LEVEL_COLOURS.get(v["level"], ("#f3f4f6", "#111827"))
        items = "".join(f"<li>{html.escape(r, quote=True)}</li>" for r in v["reasons"])
        cards.append(
            f'<div style="background:{bg};color:{fg};border-radius:8px;padding:.6em 1em;margin:.5em 0">'
            f"<b>{html.escape(v['headline'], quote=True)}</b><ul>{items}</ul></div>"
        )
    if verdicts:
        th = "; ".join(html.escape(t, quote=True) for t in verdicts[0]["thresholds"])
        cards.append(f'<p style="font-size:12px;color:#555">Thresholds: {th}</p>')
    return "".join(cards)
