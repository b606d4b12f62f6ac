"""Per-token divergence metrics and their summaries, exactly as DESIGN.md defines them.

Inputs are float64 widenings of each engine's float32 logprobs; nothing is rounded before comparing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

SUMMARY_KEYS = (
    "n_tokens",
    "max_abs_delta",
    "mean_abs_delta",
    "p50_abs_delta",
    "p95_abs_delta",
    "p99_abs_delta",
    "mean_delta",
    "max_prob_delta",
    "mean_prob_delta",
    "argmax_agreement",
    "mean_kl_topk",
    "pearson_prob",
    "seq_logprob_delta",
    "frac_ratio_outside_0.9_1.1",
)


@dataclass(frozen=True, eq=False)
class TokenMetrics:
    """Arrays over positions; NaN (argmax_agree and scored False) where a position is unscored."""

    scored: np.ndarray  # bool
    hf_prob: np.ndarray
    vllm_prob: np.ndarray
    delta: np.ndarray  # l_v - l_h
    abs_delta: np.ndarray
    prob_delta: np.ndarray
    kl_topk: np.ndarray
    argmax_agree: np.ndarray  # bool


def token_metrics(
    hf_logprob: np.ndarray,
    vllm_logprob: np.ndarray,
    hf_top1: np.ndarray,
    vllm_top1: np.ndarray,
    vllm_topk_logprobs: np.ndarray,
    hf_at_vllm_topk: np.ndarray,
) -> TokenMetrics:
    """l_h, l_v: each side's log p(token t) [T]; top1: each side's most likely id [T]; the last two
    [T, k]: vLLM's top-k logprobs and HF's logprobs of those same ids."""
    lh = np.asarray(hf_logprob, dtype=np.float64)
    lv = np.asarray(vllm_logprob, dtype=np.float64)
    scored = np.isfinite(lh) & np.isfinite(lv)
    ph = np.where(scored, np.exp(lh), np.nan)
    pv = np.where(scored, np.exp(lv), np.nan)
    delta = np.where(scored, lv - lh, np.nan)
    kl = np.where(scored, kl_topk(hf_at_vllm_topk, vllm_topk_logprobs), np.nan)
    agree = scored & (np.asarray(hf_top1) == np.asarray(vllm_top1))
    return TokenMetrics(scored, ph, pv, delta, np.abs(delta), np.abs(pv - ph), kl, agree)


def kl_topk(hf_lp: np.ndarray, vllm_lp: np.ndarray) -> np.ndarray:
    """KL(HF || vLLM) over {each id in vLLM's top-k} + {the rest as one tail bucket}, per row.

    A lower bound of the full KL (merging outcomes never raises KL), exact from values vLLM
    returned plus HF's exact values on the same ids. NaN entries (no id) are left out.
    """
    lh = np.asarray(hf_lp, dtype=np.float64)
    lv = np.asarray(vllm_lp, dtype=np.float64)
    valid = np.isfinite(lh) & np.isfinite(lv)
    lh0, lv0 = np.where(valid, lh, 0.0), np.where(valid, lv, 0.0)
    ph = np.where(valid, np.exp(lh0), 0.0)
    pv = np.where(valid, np.exp(lv0), 0.0)
    head = np.sum(ph * (lh0 - lv0), axis=-1)
    tail_h = np.clip(1.0 - ph.sum(axis=-1), 0.0, None)
    tail_v = np.clip(1.0 - pv.sum(axis=-1), np.finfo(np.float64).tiny, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(tail_h > 0, tail_h * (np.log(tail_h) - np.log(tail_v)), 0.0)
    return np.where(valid.any(axis=-1), head + tail, np.nan)


def summarize(m: TokenMetrics) -> dict[str, float | int | None]:
    """The DESIGN.md summary keys over the scored positions; None where a value is undefined."""
    s = m.scored
    n = int(s.sum())
    if n == 0:
        return {k: (0 if k == "n_tokens" else None) for k in SUMMARY_KEYS}
    d, ad, pd_, kl = m.delta[s], m.abs_delta[s], m.prob_delta[s], m.kl_topk[s]
    p50, p95, p99 = np.percentile(ad, [50, 95, 99])
    ratio = np.exp(d)
    return {
        "n_tokens": n,
        "max_abs_delta": float(ad.max()),
        "mean_abs_delta": float(ad.mean()),
        "p50_abs_delta": float(p50),
        "p95_abs_delta": float(p95),
        "p99_abs_delta": float(p99),
        "mean_delta": float(d.mean()),
        "max_prob_delta": float(pd_.max()),
        "mean_prob_delta": float(pd_.mean()),
        "argmax_agreement": float(m.argmax_agree[s].mean()),
        "mean_kl_topk": float(np.mean(kl[np.isfinite(kl)])) if np.isfinite(kl).any() else None,
        "pearson_prob": _pearson(m.hf_prob[s], m.vllm_prob[s]),
        "seq_logprob_delta": float(d.sum()),
        "frac_ratio_outside_0.9_1.1": float(((ratio < 0.9) | (ratio > 1.1)).mean()),
    }


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def concat(parts: list[TokenMetrics]) -> TokenMetrics:
    """All sequences' positions as one, for the run-level summary."""
    return TokenMetrics(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(TokenMetrics)))
