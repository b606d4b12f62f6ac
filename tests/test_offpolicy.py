"""The RL mismatch metrics against hand computations, and HF's kept-mass rule against brute force."""

import math

import numpy as np
import pytest
import torch

from logprob_parity.engines.backends.hf import _log_kept_mass
from logprob_parity.results.offpolicy import METRIC_KEYS, floor_stats, mismatch_metrics, mismatch_metrics_each

# Two sequences. Rollout (vLLM decode) and trainer (HF) logprobs chosen so every ratio is round:
# log ρ = trainer − rollout = [ln 2, 0, −ln 2] and [ln 1.25].
ROLLOUT = [np.log([0.25, 0.5, 0.5]), np.log([0.4])]
TRAINER = [np.log([0.5, 0.5, 0.25]), np.log([0.5])]


def test_every_metric_matches_a_hand_computation():
    m = mismatch_metrics(ROLLOUT, TRAINER, tis_cap=1.5, mis_band=(0.6, 1.5))
    l2, l125 = math.log(2), math.log(1.25)
    rho = [2.0, 1.0, 0.5, 1.25]
    log_rho = [l2, 0.0, -l2, l125]
    delta = [-x for x in log_rho]
    assert m["n_tokens"] == 4 and m["n_sequences"] == 2
    assert m["mean_abs_delta"] == pytest.approx((2 * l2 + l125) / 4, abs=1e-12)
    assert m["max_abs_delta"] == pytest.approx(l2, abs=1e-12)
    assert m["mean_delta"] == pytest.approx(sum(delta) / 4, abs=1e-12)
    assert m["kl"] == pytest.approx(sum(delta) / 4, abs=1e-12)
    assert m["k2_kl"] == pytest.approx(sum(0.5 * x * x for x in log_rho) / 4, abs=1e-12)
    assert m["k3_kl"] == pytest.approx(sum(r - 1 - x for r, x in zip(rho, log_rho)) / 4, abs=1e-12)
    assert m["chi2_token"] == pytest.approx(sum(r * r for r in rho) / 4 - 1, abs=1e-12)
    # sequence log-ratios: ln2 + 0 − ln2 = 0 and ln 1.25
    assert m["chi2_seq"] == pytest.approx((1.0 + 1.25**2) / 2 - 1, abs=1e-12)
    assert m["seq_log_ratio_mean"] == pytest.approx(l125 / 2, abs=1e-12)
    assert (m["seq_log_ratio_min"], m["seq_log_ratio_max"]) == (pytest.approx(0.0, abs=1e-12), pytest.approx(l125))
    assert (m["rollout_is_min"], m["rollout_is_max"]) == (pytest.approx(0.5), pytest.approx(2.0))
    assert m["rollout_is_mean"] == pytest.approx(4.75 / 4)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(4.75**2 / (4 * (4 + 1 + 0.25 + 1.5625)))
    assert m["frac_ratio_outside_0.8_1.25"] == pytest.approx(0.5)  # 2 and 0.5 leave it; 1.25 is on its edge
    assert m["frac_ratio_outside_0.5_2"] == pytest.approx(0.0)  # both ends are inside
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1 + 2 + 1.25) / 4)
    assert m["tis_clip_fraction"] == pytest.approx(0.25)  # only 2 > 1.5
    assert m["mis_mask_fraction"] == pytest.approx(0.5)  # 2 > 1.5 and 0.5 < 0.6
    # perplexities per sequence: exp(−mean l), then averaged over the two sequences
    r1, t1 = np.mean(np.log([0.25, 0.5, 0.5])), np.mean(np.log([0.5, 0.5, 0.25]))
    r2, t2 = math.log(0.4), math.log(0.5)
    assert m["training_ppl"] == pytest.approx((math.exp(-t1) + math.exp(-t2)) / 2)
    assert m["rollout_ppl"] == pytest.approx((math.exp(-r1) + math.exp(-r2)) / 2)
    assert m["ppl_ratio"] == pytest.approx((math.exp(r1 - t1) + math.exp(r2 - t2)) / 2)
    dp = np.array([0.25 - 0.5, 0.0, 0.5 - 0.25, 0.4 - 0.5])
    assert m["dp_mean"] == pytest.approx(dp.mean()) and m["dp_rms"] == pytest.approx(math.sqrt(np.mean(dp**2)))
    assert set(METRIC_KEYS) <= set(m)


def test_identical_sides_are_a_perfect_match():
    m = mismatch_metrics(ROLLOUT, ROLLOUT)
    assert m["max_abs_delta"] == 0 and m["kl"] == 0 and m["k3_kl"] == 0 and m["chi2_token"] == 0
    assert m["rollout_is_eff_sample_size"] == 1 and m["token_mult_prob_error"] == 1 and m["ppl_ratio"] == 1


def test_no_tokens_gives_counts_of_zero_and_no_numbers():
    m = mismatch_metrics([], [])
    assert m["n_tokens"] == 0 and m["mean_abs_delta"] is None and m["rollout_is_max"] is None


def test_one_wild_token_cannot_overflow_the_ratio_statistics():
    m = mismatch_metrics([np.array([-200.0, -1.0])], [np.array([-0.1, -1.0])])
    assert math.isfinite(m["chi2_token"]) and math.isfinite(m["chi2_seq"]) and m["rollout_is_max"] == pytest.approx(math.exp(20))
    assert m["max_abs_delta"] == pytest.approx(199.9)  # Δ itself is never clamped


def test_lengths_that_differ_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        mismatch_metrics([np.zeros(3)], [np.zeros(2)])


def test_each_sequences_metrics_at_once_are_one_call_a_sequence():
    """mismatch_metrics_each (a rescore's per-sequence metrics, all sequences of one length at once)
    gives exactly what one mismatch_metrics call a sequence gives: mixed lengths, an empty sequence,
    a wild token past the safety bound, and the hand-checked pair above."""
    rng = np.random.default_rng(7)
    lens = [3, 1, 0, 5, 3, 5, 17, 1, 3]
    rollout = [-rng.random(n) * 3 for n in lens] + ROLLOUT
    trainer = [r + rng.normal(0, 0.2, len(r)) for r in rollout[: len(lens)]] + TRAINER
    trainer[3] = trainer[3].copy()
    trainer[3][2] = -60.0  # log ρ beyond ±20: clipped the same way in both
    got = mismatch_metrics_each(rollout, trainer, tis_cap=1.5, mis_band=(0.6, 1.5))
    want = [mismatch_metrics([r], [t], tis_cap=1.5, mis_band=(0.6, 1.5)) for r, t in zip(rollout, trainer)]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), i
        for k in w:
            assert g[k] == w[k] or (g[k] != g[k] and w[k] != w[k]), (i, k, g[k], w[k])  # equal, never rounded
    assert got[2]["n_tokens"] == 0 and got[2]["mean_abs_delta"] is None
    with pytest.raises(ValueError):
        mismatch_metrics_each([np.zeros(2)], [np.zeros(3)])


def test_floor_stats_are_mean_and_max_over_all_tokens():
    f = floor_stats([np.array([0.0, 1.0]), np.array([2.0])], [np.array([0.5, 1.0]), np.array([1.0])])
    assert f == {"mean": pytest.approx(0.5), "max": pytest.approx(1.0), "n": 3}


def _kept_brute(lp: np.ndarray, top_k: int, top_p: float) -> float:
    """vLLM's rule spelled out per row: top-k by value (ties kept), then top-p over the renormalised
    rest, cutting ascending cumulative sums <= 1 - p, never the most likely token."""
    keep = np.ones_like(lp, dtype=bool)
    if 0 < top_k < len(lp):
        keep &= lp >= np.sort(lp)[::-1][top_k - 1]
    if top_p < 1:
        p = np.where(keep, np.exp(lp), 0.0)
        p = p / p.sum()
        order = np.argsort(p, kind="stable")
        cum = np.cumsum(p[order])
        cut = cum <= 1 - top_p
        cut[-1] = False
        keep[order[cut]] = False
    return float(np.log(np.exp(lp[keep]).sum()))


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (3, 1.0), (-1, 0.7), (4, 0.8), (1, 0.5)])
def test_hf_kept_mass_follows_vllms_top_k_then_top_p(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(6, 11, generator=g, dtype=torch.float64), dim=-1)
    got = _log_kept_mass(lp, top_k, top_p).numpy()
    want = [_kept_brute(row, top_k, top_p) for row in lp.numpy()]
    assert np.allclose(got, want, atol=1e-12), (got, want)
    if top_k < 0 and top_p == 1.0:
        assert np.allclose(got, 0.0, atol=1e-12)  # nothing cut: the whole mass, log 1
