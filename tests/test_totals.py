"""The summary of a rollout read in parts (logprob_parity.results.totals) against the whole-array functions:
counts, extremes and quantiles exactly, sums and means to 1e-12 relative."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from logprob_parity.results.offpolicy import mismatch_metrics
from logprob_parity.results.rollout import EXACT, PAIRS, exact_stats
from logprob_parity.results.totals import Quantiles, linear_quantile, streamed_summary

# per-token values and their order statistics; a sequence's Σ log ρ is a sum (its extremes are not exact)
EXACTLY = {
    "n_tokens",
    "n_sequences",
    "max_abs_delta",
    "p99_abs_delta",
    "rollout_is_min",
    "rollout_is_max",
    "kl_full_max",
    "tis_cap",
    "mis_band",
    *(f"kl_full_{k}" for k in ("p99_9", "p99", "p95", "p90", "p50", "p10", "p5", "p1", "p0_1")),
}


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001, 65537])
def test_linear_quantile_is_numpys_to_the_bit(n):
    rng = np.random.default_rng(n)
    x = np.sort(np.concatenate([rng.standard_normal(n // 2) * 1e-3, rng.exponential(2.0, n - n // 2)]))
    for q in (0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0):
        assert linear_quantile(n, q, lambda k: x[k]) == np.quantile(x, q)
    for q in (99.9, 99.0, 50.0, 0.1):
        assert linear_quantile(n, q / 100, lambda k: x[k]) == np.percentile(x, q)


def test_quantiles_from_two_passes_over_parts_equal_numpys_on_the_whole():
    rng = np.random.default_rng(1)
    parts = [rng.lognormal(-6, 3, size) for size in (5, 1000, 0, 40_000, 3)]
    parts.append(np.full(500, parts[1][0]))  # many equal values: one bucket holds them all
    qs = Quantiles((0.001, 0.5, 0.99, 0.999))
    for p in parts:
        qs.count(p)
    for p in parts:
        qs.gather(p)
    whole = np.concatenate(parts)
    assert qs.values() == [float(np.quantile(whole, q)) for q in (0.001, 0.5, 0.99, 0.999)]


def _samples(rng, lengths):
    out = []
    for n in lengths:
        hf = -rng.exponential(1.5, n)
        lp = {
            "decode_raw": hf + rng.standard_normal(n) * 0.05,
            "prefill": hf + rng.standard_normal(n) * 1e-3,
            "hf": hf,
            "decode_processed": hf + rng.standard_normal(n) * 0.05,
            "hf_tempered": hf * 1.1,
            "log_kept_mass": np.zeros(n),
        }
        lp["decode_raw"][rng.integers(0, n)] -= 3.0 if n > 3 else 0.0  # a wild token now and then
        out.append((lp, {"kl_full": rng.exponential(1e-4, n), "same_top": (rng.random(n) > 0.02).astype(np.float64)}))
    return out


def test_a_summary_streamed_over_parts_equals_the_whole_set_metrics():
    rng = np.random.default_rng(7)
    samples = _samples(rng, rng.integers(1, 200, 300).tolist())
    cuts = [0, 1, 50, 51, 200, 300]

    def parts():
        for lo, hi in itertools.pairwise(cuts):
            part = samples[lo:hi]
            yield {
                **{c: np.concatenate([lp[c] for lp, _ in part]) for c in part[0][0]},
                **{c: np.concatenate([ex[c] for _, ex in part]) for c in EXACT},
                "lengths": np.array([len(lp["hf"]) for lp, _ in part]),
            }

    got = streamed_summary(parts, PAIRS, "prefill_vs_hf")

    class S:  # what exact_stats reads of a sample
        def __init__(self, ex):
            self.exact = ex

    for pair, (a, b, _) in PAIRS.items():
        want = mismatch_metrics([lp[a] for lp, _ in samples], [lp[b] for lp, _ in samples])
        if pair == "prefill_vs_hf":
            want.update(exact_stats([S(ex) for _, ex in samples]))
        assert set(got[pair]) == set(want), pair
        for k, v in want.items():
            g = got[pair][k]
            if k in EXACTLY or v is None or isinstance(v, (list, int)):
                assert g == v, (pair, k, g, v)
            else:
                assert math.isclose(g, v, rel_tol=1e-12, abs_tol=1e-300), (pair, k, g, v)


def test_a_token_without_its_exact_kl_leaves_the_kl_statistics_empty_as_in_memory():
    rng = np.random.default_rng(3)
    samples = _samples(rng, [5, 6])
    samples[1][1]["kl_full"][2] = np.nan

    def parts():
        for lp, ex in samples:
            yield {**lp, **ex, "lengths": np.array([len(lp["hf"])])}

    got = streamed_summary(parts, PAIRS, "prefill_vs_hf")["prefill_vs_hf"]
    assert got["kl_full_mean"] is None and got["kl_full_p50"] is None and got["same_top_p"] is not None
