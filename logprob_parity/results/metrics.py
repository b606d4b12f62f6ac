"""Per-token divergence metrics and their summaries, exactly as DESIGN.md defines them.

Inputs are float64 widenings of each engine's float32 logprobs; nothing is rounded before comparing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

# Percentiles of the exact full-vocabulary KL(HF || vLLM) per token, as llama.cpp reports them.
KL_PERCENTILES = (
    ("p99_9", 99.9),
    ("p99", 99.0),
    ("p95", 95.0),
    ("p90", 90.0),
    ("p50", 50.0),
    ("p10", 10.0),
    ("p5", 5.0),
    ("p1", 1.0),
    ("p0_1", 0.1),
)
FULL_KL_KEYS = ("kl_full_mean", "kl_full_max", *(f"kl_full_{k}" for k, _ in KL_PERCENTILES))

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
    # llama.cpp's `perplexity --kl-divergence` set, HF the base and vLLM the other model:
    *FULL_KL_KEYS,
    "kl_full_mean_err",
    "same_top_p",
    "same_top_p_err",
    "dp_mean",
    "dp_rms",
    "ppl_ratio",
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
    # exact KL(HF || vLLM) over the whole vocabulary; NaN where it was not computed (older runs, or
    # a run too large for it: logprob_parity.analysis.compare.FULL_KL_MAX_BYTES)
    kl_full: np.ndarray | None = None


def token_metrics(
    hf_logprob: np.ndarray,
    vllm_logprob: np.ndarray,
    hf_top1: np.ndarray,
    vllm_top1: np.ndarray,
    vllm_topk_logprobs: np.ndarray,
    hf_at_vllm_topk: np.ndarray,
    kl_full: np.ndarray | None = None,
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
    full = np.full(len(lh), np.nan) if kl_full is None else np.where(scored, np.asarray(kl_full, dtype=np.float64), np.nan)
    return TokenMetrics(scored, ph, pv, delta, np.abs(delta), np.abs(pv - ph), kl, agree, full)


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
    return summarize_each(m, [len(m.scored)])[0]


def summarize_each(m: TokenMetrics, lengths: list[int]) -> list[dict[str, float | int | None]]:
    """`summarize` of each sequence of a batch (lengths: its consecutive position counts), bit for
    bit: the sequences with the same number of scored positions stack into one [rows, n] block and
    every statistic is one numpy reduction a block (one call a sequence cost more than the engines'
    own time on a 64 x 512-token comparison)."""
    import itertools

    lengths = [int(n) for n in lengths]
    starts = [0, *itertools.accumulate(lengths)]
    scored = np.flatnonzero(m.scored)
    seq_of = np.searchsorted(np.asarray(starts[1:], dtype=np.int64), scored, side="right")
    counts = np.bincount(seq_of, minlength=len(lengths))
    out: list[dict[str, float | int | None]] = [{} for _ in lengths]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(counts.tolist()):
        groups.setdefault(n, []).append(i)
    for n, members in groups.items():
        if n == 0:
            for i in members:
                out[i] = {k: (0 if k == "n_tokens" else None) for k in SUMMARY_KEYS}
            continue
        # each member's scored positions, in order: a [rows, n] index into the batch's positions
        firsts = np.searchsorted(seq_of, np.asarray(members, dtype=np.int64), side="left")
        at = scored[firsts[:, None] + np.arange(n)]
        for i, row in zip(members, _summary_rows(m, at, n)):
            out[i] = row
    return out


def _summary_rows(m: TokenMetrics, at: np.ndarray, n: int) -> list[dict[str, float | int | None]]:
    """The summary of each row of `at` [rows, n]: indices of n scored positions a row. One
    definition for a whole run (one row) and for each sequence (`summarize_each`)."""
    rows = at.shape[0]
    d, ad, pd_, kl = m.delta[at], m.abs_delta[at], m.prob_delta[at], m.kl_topk[at]
    hp, vp, agree = m.hf_prob[at], m.vllm_prob[at], m.argmax_agree[at]
    pct = np.percentile(ad, [50, 95, 99], axis=1)
    ratio = np.exp(d)
    finite = np.isfinite(kl)
    all_finite = finite.all(axis=1)
    kl_mean = np.where(all_finite, np.mean(np.where(finite, kl, 0.0), axis=1), np.nan).tolist()
    dp = vp - hp
    cols = {
        "max_abs_delta": ad.max(axis=1),
        "mean_abs_delta": ad.mean(axis=1),
        "p50_abs_delta": pct[0],
        "p95_abs_delta": pct[1],
        "p99_abs_delta": pct[2],
        "mean_delta": d.mean(axis=1),
        "max_prob_delta": pd_.max(axis=1),
        "mean_prob_delta": pd_.mean(axis=1),
        "argmax_agreement": agree.mean(axis=1),
        "seq_logprob_delta": d.sum(axis=1),
        "frac_ratio_outside_0.9_1.1": ((ratio < 0.9) | (ratio > 1.1)).mean(axis=1),
        "dp_mean": dp.mean(axis=1),
        "dp_rms": np.sqrt(np.mean(dp**2, axis=1)),
        "ppl_ratio": np.exp(-np.mean(d, axis=1)),
    }
    lists = {k: v.tolist() for k, v in cols.items()}
    same = same_top_stats_rows(agree.astype(bool))
    exact = exact_kl_stats_rows(
        m.kl_full[at].astype(np.float64, copy=False) if m.kl_full is not None else np.full((rows, n), np.nan)
    )
    out = []
    for j in range(rows):
        if all_finite[j]:
            mean_kl = kl_mean[j]
        else:  # the mean over this row's finite values alone (an unusual row: one call)
            mean_kl = float(np.mean(kl[j][finite[j]])) if finite[j].any() else None
        row: dict[str, float | int | None] = {
            "n_tokens": n,
            **{k: v[j] for k, v in lists.items()},
            "mean_kl_topk": mean_kl,
            "pearson_prob": _pearson(hp[j], vp[j]),
            **same[j],
            **exact[j],
        }
        out.append({k: row[k] for k in SUMMARY_KEYS})
    return out


def llama_cpp_stats(m: TokenMetrics) -> dict[str, float | None]:
    """llama.cpp's KL-divergence statistics over the scored positions (HF the base, vLLM the other):
    the exact KL's mean ± its standard error, max and percentiles; "same top p" (both engines' most
    likely token agree) ± its binomial error sqrt(p(1−p)/(n−1)); Δp = p_vLLM − p_HF of the token,
    its mean and RMS; and the perplexity ratio PPL(vLLM)/PPL(HF) = exp(mean(l_HF − l_vLLM)).
    (Part of `summarize`, which computes them.)"""
    s = summarize(m)
    return {
        k: s[k] for k in (*FULL_KL_KEYS, "kl_full_mean_err", "same_top_p", "same_top_p_err", "dp_mean", "dp_rms", "ppl_ratio")
    }


def exact_kl_stats(kl: np.ndarray) -> dict[str, float | None]:
    """The exact KL's mean ± standard error, max and percentiles over these positions; all None
    unless every position has its exact KL (a partial mean would describe other tokens)."""
    return exact_kl_stats_rows(np.asarray(kl, dtype=np.float64).reshape(1, -1))[0]


def exact_kl_stats_rows(kl: np.ndarray) -> list[dict[str, float | None]]:
    """exact_kl_stats of each row of kl [rows, positions], computed for all rows at once."""
    rows, n = kl.shape
    out: list[dict[str, float | None]] = [dict.fromkeys((*FULL_KL_KEYS, "kl_full_mean_err")) for _ in range(rows)]
    ok = np.flatnonzero(np.isfinite(kl).all(axis=1)) if n else np.zeros(0, dtype=np.int64)
    if not len(ok):
        return out
    x = kl[ok]
    cols = {"kl_full_mean": x.mean(axis=1), "kl_full_max": x.max(axis=1)}
    if n > 1:
        cols["kl_full_mean_err"] = x.std(axis=1, ddof=1) / np.sqrt(n)
    for (key, _), v in zip(KL_PERCENTILES, np.percentile(x, [q for _, q in KL_PERCENTILES], axis=1)):
        cols[f"kl_full_{key}"] = v
    lists = {k: v.tolist() for k, v in cols.items()}
    for j, i in enumerate(ok.tolist()):
        out[i].update({k: v[j] for k, v in lists.items()})
    return out


def same_top_stats(agree: np.ndarray) -> dict[str, float | None]:
    """llama.cpp's "same top p": the share of positions where both engines' most likely token is
    the same, ± its binomial error sqrt(p(1−p)/(n−1))."""
    return same_top_stats_rows(np.asarray(agree, dtype=bool).reshape(1, -1))[0]


def same_top_stats_rows(agree: np.ndarray) -> list[dict[str, float | None]]:
    """same_top_stats of each row of agree [rows, positions] (bool), computed for all rows at once."""
    rows, n = agree.shape
    if n == 0:
        return [{"same_top_p": None, "same_top_p_err": None} for _ in range(rows)]
    same = agree.mean(axis=1)
    err = np.sqrt(same * (1 - same) / (n - 1)).tolist() if n > 1 else [None] * rows
    return [{"same_top_p": p, "same_top_p_err": e} for p, e in zip(same.tolist(), err)]


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def concat(parts: list[TokenMetrics]) -> TokenMetrics:
    """All sequences' positions as one, for the run-level summary."""

    def col(p: TokenMetrics, name: str) -> np.ndarray:
        v = getattr(p, name)
        return np.full(len(p.scored), np.nan) if v is None else v

    return TokenMetrics(*(np.concatenate([col(p, f.name) for p in parts]) for f in fields(TokenMetrics)))
