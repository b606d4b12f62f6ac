"""Each token's band: what its colour in the token view says, one rule for the page, the report, the
JSON, the Parquet, `show` and `check`.

- `noise`: its |Δ logp| is within the tail of HF's own per-token noise (`hf_noise_tail`: the 99.5th
  percentile of how far HF moves a token against itself under a trainer's variations,
  logprob_parity.analysis.floors), whatever vLLM's tolerance says;
- `tolerance`: beyond that tail, but within vLLM's own (looser) test tolerance;
- `beyond`: beyond both: red, a token that is a problem.

Why the tail and not the mean: HF's per-token noise is mostly 0 with a long tail (bfloat16 on the
demo model: mean 0.009, 99th percentile 0.13), so a token judged against the mean reads as beyond it
about half the time in pure noise. Where the tail was not measured (a run without its noise floor),
the largest value HF moved (`hf_noise_max`) stands in, and without that one rounding step of the
dtype; the legend says which.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# vLLM's own tests accept logprob differences of 1e-2 (tight) to 2e-2 (loose) between engines.
VLLM_TEST_TOL = (1e-2, 2e-2)
BANDS = ("noise", "tolerance", "beyond")
# A probability change that matters: a token whose probability moves by 10 percentage points or more.
# A large ratio on an improbable token (1e-9 -> 5e-9) is not one.
MATERIAL_P = 0.1
# One rounding step of each dtype (machine epsilon): what stands in for a noise not measured.
DTYPE_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
TAIL_Q = 0.995  # the noise's tail: a token beyond this quantile of HF's per-token noise is beyond the noise
TAIL_MIN_POSITIONS = 400  # a sample shorter than this is topped up with other texts: a 99.5th percentile needs them
# the noise floor's variations, in the order measured (logprob_parity.analysis.floors says what each is)
VARIATIONS = ("micro_batch", "padding_side", "packed", "chunked_kv")
# Two-sided 99% for the Wilson intervals that compare a share of tokens with what noise gives.
Z = 2.576
BAND_KEYS = (
    "tokens_beyond",
    "tokens_beyond_frac",
    "tokens_above_noise",
    "tokens_above_noise_frac",
    "material_beyond",
    "argmax_flips",
    "noise_limit",
    "noise_limit_source",
)


def noise_limit(summary: dict[str, Any], dtype: str) -> tuple[float, str]:
    """Where a token's gap leaves HF's noise, and where that number comes from: 'tail' (measured:
    the noise's 99.5th percentile or, on few positions, its largest value), 'max' (a run stored before
    the tail: the largest value HF moved), or 'unmeasured' (one rounding step stands in)."""
    if summary.get("hf_noise_tail") is not None:
        return float(summary["hf_noise_tail"]), "tail"
    if summary.get("hf_noise_max") is not None:
        return float(summary["hf_noise_max"]), "max"
    return DTYPE_EPS.get(dtype, 2.0**-23), "unmeasured"


def band_of(value: float, limit: float) -> str | None:
    """The band of one gap; None where the position is unscored (NaN)."""
    if not math.isfinite(value):
        return None
    if value <= limit:
        return "noise"
    return "beyond" if value > VLLM_TEST_TOL[1] else "tolerance"


def bands(abs_delta: Any, limit: float) -> list[str | None]:
    """band_of of each position."""
    return [band_of(v, limit) for v in np.asarray(abs_delta, np.float64).tolist()]


def band_stats(abs_delta: Any, prob_delta: Any, argmax_agree: Any, scored: Any, limit: float, source: str) -> dict[str, Any]:
    """The band counts of these positions (BAND_KEYS): how many tokens are beyond both the noise and the
    tolerance, how many beyond the noise at all, how many of the red ones moved a probability by
    MATERIAL_P or more, and how many argmax flips."""
    ok = np.asarray(scored, bool)
    ad = np.asarray(abs_delta, np.float64)[ok]
    pd_ = np.asarray(prob_delta, np.float64)[ok]
    n = int(ad.size)
    above = ad > limit
    beyond = above & (ad > VLLM_TEST_TOL[1])
    return {
        "tokens_beyond": int(beyond.sum()),
        "tokens_beyond_frac": float(beyond.mean()) if n else None,
        "tokens_above_noise": int(above.sum()),
        "tokens_above_noise_frac": float(above.mean()) if n else None,
        "material_beyond": int((beyond & (pd_ >= MATERIAL_P)).sum()),
        "argmax_flips": int((~np.asarray(argmax_agree, bool)[ok]).sum()),
        "noise_limit": float(limit),
        "noise_limit_source": source,
    }


def metrics_band_stats(m: Any, summary: dict[str, Any], dtype: str) -> dict[str, Any]:
    """band_stats of TokenMetrics `m`, against the noise limit its summary holds."""
    limit, source = noise_limit(summary, dtype)
    return band_stats(m.abs_delta, m.prob_delta, m.argmax_agree, m.scored, limit, source)


def pair_band_stats(chunks: Any, limit: float, source: str) -> dict[str, Any]:
    """band_stats of a rollout's pair over (rollout side, trainer side) logprob chunks, added up a chunk
    at a time (a rescore's parts never sit in memory together). No argmax here: a decode keeps only its
    sampled token, so argmax_flips is None."""
    tot = {"n": 0, "tokens_beyond": 0, "tokens_above_noise": 0, "material_beyond": 0}
    for a, b in chunks:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ok = np.isfinite(a) & np.isfinite(b)
        ad = np.abs(a[ok] - b[ok])
        pd_ = np.abs(np.exp(a[ok]) - np.exp(b[ok]))
        above = ad > limit
        beyond = above & (ad > VLLM_TEST_TOL[1])
        tot["n"] += int(ad.size)
        tot["tokens_beyond"] += int(beyond.sum())
        tot["tokens_above_noise"] += int(above.sum())
        tot["material_beyond"] += int((beyond & (pd_ >= MATERIAL_P)).sum())
    n = tot.pop("n")
    return {
        **tot,
        "tokens_beyond_frac": tot["tokens_beyond"] / n if n else None,
        "tokens_above_noise_frac": tot["tokens_above_noise"] / n if n else None,
        "argmax_flips": None,
        "noise_limit": float(limit),
        "noise_limit_source": source,
    }


def wilson(k: int, n: int, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a share k/n: (low, high). (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def share_beyond(k: int, n: int, allowed: float) -> bool:
    """More than `allowed` of the n tokens, with 99% confidence: k/n's Wilson interval lies wholly above it.
    Why a test and not k/n > allowed: a noise tail at its 99.5th percentile leaves 0.5% of noise beyond it,
    and a sample's share wanders about that."""
    return n > 0 and wilson(k, n)[0] > allowed


def more_than_noise(k: int, n: int, k0: int, n0: int) -> bool:
    """k of n is more than noise's k0 of n0, with 99% confidence: the gap's share lies wholly above the
    noise's (their Wilson intervals do not meet). Used for argmax flips against HF's own flips, and for
    tokens beyond the noise's tail against the noise's own positions beyond it (which carries the
    uncertainty of a tail estimated on a few hundred positions)."""
    return n > 0 and n0 > 0 and wilson(k, n)[0] > wilson(k0, n0)[1]


def tail_of(variations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The noise's tail and argmax flips from measured variations: the largest variation's TAIL_Q
    quantile of per-token |Δ logp| (`hf_noise_tail`, on `noise_tail_positions` positions of that
    variation; the variation's largest value where it had fewer than TAIL_MIN_POSITIONS), and the
    largest share of positions whose most likely next token HF changed itself (`hf_noise_flip_frac`).
    Floors stored before the tail was measured give None: their tokens are judged as unmeasured."""
    env = variations.get("envelope")
    got = (
        {"envelope": env}
        if env and env.get("tail") is not None
        else {k: v for k, v in variations.items() if k in VARIATIONS and v.get("tail") is not None}
    )
    out: dict[str, Any] = {
        "hf_noise_tail": None,
        "noise_tail_q": None,
        "noise_tail_positions": None,
        "noise_tail_beyond": None,
        "hf_noise_flip_frac": None,
        "noise_flip_positions": None,
    }
    if got:
        key = max(got, key=lambda k: (got[k]["tail"], -VARIATIONS.index(k) if k in VARIATIONS else 0))
        n = int(got[key]["n"])
        out.update(
            hf_noise_tail=got[key]["tail"],
            noise_tail_q=TAIL_Q if n >= TAIL_MIN_POSITIONS else None,
            noise_tail_positions=n,
            noise_tail_beyond=got[key].get("beyond_tail"),
        )
    fl = {k: v for k, v in variations.items() if k in VARIATIONS and v.get("flip_n")}
    if fl:
        key = max(fl, key=lambda k: fl[k]["flips"] / fl[k]["flip_n"])
        out.update(hf_noise_flip_frac=fl[key]["flips"] / fl[key]["flip_n"], noise_flip_positions=int(fl[key]["flip_n"]))
    return out


def tail_words(floor: dict[str, Any]) -> str | None:
    """Where the noise's tail lies, in words a reader can check: 'HF moved 99.5% of 480 tokens by at
    most 0.11 against itself'; None when not measured."""
    t, n = floor.get("hf_noise_tail"), floor.get("noise_tail_positions")
    if t is None or not n:
        return None
    if floor.get("noise_tail_q"):
        return f"HF moved {floor['noise_tail_q'] * 100:g}% of {n:,} tokens by at most {t:.2g} against itself"
    return f"HF moved {n:,} tokens by at most {t:.2g} against itself, the largest: too few for a {TAIL_Q * 100:g}% quantile"


LEVELS = ("match", "unmeasured", "systematic", "close", "differs")  # from best to worst
# a verdict's level in the pages' words (logprob_parity.analysis.verdict makes the verdicts; Run.verdict reads them)
LEVEL_WORDS = {
    "match": "Match",
    "unmeasured": "Within tolerance, noise not yet measured",
    "systematic": "Small but systematic",
    "close": "Close",
    "differs": "Differs",
}
