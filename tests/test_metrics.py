"""Every metric against values computed by hand."""

import math

import numpy as np
import pytest

from logprob_parity.results.metrics import SUMMARY_KEYS, concat, kl_topk, summarize, token_metrics

NAN = float("nan")


def _m():
    # position 0 unscored; 1: HF 0.5 vs vLLM 0.4; 2: equal 0.25; 3: HF 0.1 vs vLLM 0.2
    lh = np.log([1.0, 0.5, 0.25, 0.1])
    lh[0] = NAN
    lv = np.log([1.0, 0.4, 0.25, 0.2])
    lv[0] = NAN
    hf_top1 = np.array([-1, 7, 3, 9])
    vl_top1 = np.array([-1, 7, 4, 9])
    vl_topk = np.log(np.array([[1, 1], [0.4, 0.4], [0.5, 0.25], [0.2, 0.1]]))
    hf_at = np.log(np.array([[1, 1], [0.5, 0.3], [0.5, 0.25], [0.1, 0.1]]))
    return token_metrics(lh, lv, hf_top1, vl_top1, vl_topk, hf_at)


def test_token_level_values():
    m = _m()
    assert m.scored.tolist() == [False, True, True, True]
    assert math.isnan(m.delta[0]) and math.isnan(m.kl_topk[0]) and not m.argmax_agree[0]
    assert m.delta[1] == pytest.approx(math.log(0.8), abs=1e-15)
    assert m.delta[2] == 0.0
    assert m.delta[3] == pytest.approx(math.log(2.0), abs=1e-15)
    assert m.abs_delta[1] == pytest.approx(0.2231435513142097, abs=1e-15)
    assert m.prob_delta[1:].tolist() == pytest.approx([0.1, 0.0, 0.1], abs=1e-15)
    assert m.argmax_agree.tolist() == [False, True, False, True]


def test_kl_topk_by_hand():
    # HF [0.5, 0.3 | tail 0.2] vs vLLM [0.4, 0.4 | tail 0.2]
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert expected == pytest.approx(0.025267154, abs=1e-9)
    assert _m().kl_topk[1] == pytest.approx(expected, abs=1e-15)
    # identical distributions on the partition: exactly zero
    assert _m().kl_topk[2] == pytest.approx(0.0, abs=1e-16)
    # HF [0.1, 0.1 | 0.8] vs vLLM [0.2, 0.1 | 0.7]
    e3 = 0.1 * math.log(0.1 / 0.2) + 0.0 + 0.8 * math.log(0.8 / 0.7)
    assert _m().kl_topk[3] == pytest.approx(e3, abs=1e-15)


def test_kl_topk_tail_edge_cases():
    # vLLM's top-k covers all the mass but HF has some outside: large but finite
    v = kl_topk(np.log([[0.5, 0.3]]), np.log([[0.5, 0.5]]))
    assert np.isfinite(v[0]) and v[0] > 1.0
    # missing ids (-1 -> NaN) are left out of the head
    w = kl_topk(np.array([[math.log(0.5), NAN]]), np.array([[math.log(0.4), NAN]]))
    assert w[0] == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6), abs=1e-15)
    assert math.isnan(kl_topk(np.array([[NAN]]), np.array([[NAN]]))[0])


def test_summary_by_hand():
    s = summarize(_m())
    assert set(s) == set(SUMMARY_KEYS)
    a, b = math.log(1.25), math.log(2.0)  # |deltas| 0.2231, 0, 0.6931
    assert s["n_tokens"] == 3
    assert s["max_abs_delta"] == pytest.approx(b, abs=1e-15)
    assert s["mean_abs_delta"] == pytest.approx((a + b) / 3, abs=1e-15)
    assert s["p50_abs_delta"] == pytest.approx(a, abs=1e-15)
    # numpy's linear interpolation between the 2nd and 3rd sorted values
    assert s["p95_abs_delta"] == pytest.approx(a + 0.9 * (b - a), abs=1e-15)
    assert s["p99_abs_delta"] == pytest.approx(a + 0.98 * (b - a), abs=1e-15)
    assert s["mean_delta"] == pytest.approx((-a + b) / 3, abs=1e-15)
    assert s["seq_logprob_delta"] == pytest.approx(-a + b, abs=1e-15)
    assert s["max_prob_delta"] == pytest.approx(0.1, abs=1e-15)
    assert s["mean_prob_delta"] == pytest.approx(0.2 / 3, abs=1e-15)
    assert s["argmax_agreement"] == pytest.approx(2 / 3)
    assert s["frac_ratio_outside_0.9_1.1"] == pytest.approx(2 / 3)  # ratios 0.8, 1, 2
    # Pearson of HF [0.5, 0.25, 0.1] against vLLM [0.4, 0.25, 0.2], by hand
    x, y = np.array([0.5, 0.25, 0.1]), np.array([0.4, 0.25, 0.2])
    dx, dy = x - x.mean(), y - y.mean()
    r = (dx * dy).sum() / math.sqrt((dx**2).sum() * (dy**2).sum())
    assert s["pearson_prob"] == pytest.approx(r, abs=1e-12)
    assert s["mean_kl_topk"] == pytest.approx(np.mean(_m().kl_topk[1:]), abs=1e-15)


def test_summary_of_nothing_and_concat():
    m = _m()
    empty = token_metrics(
        np.array([NAN]), np.array([NAN]), np.array([-1]), np.array([-1]), np.full((1, 2), NAN), np.full((1, 2), NAN)
    )
    s = summarize(empty)
    assert s["n_tokens"] == 0 and s["max_abs_delta"] is None
    both = summarize(concat([m, empty, m]))
    assert both["n_tokens"] == 6
    assert both["seq_logprob_delta"] == pytest.approx(2 * summarize(m)["seq_logprob_delta"], abs=1e-15)


def test_no_rounding_of_float32_neighbours():
    lh = np.array([NAN, np.float32(-1.0)], dtype=np.float64)
    lv = np.array([NAN, np.nextafter(np.float32(-1.0), np.float32(0))], dtype=np.float64)
    m = token_metrics(lh, lv, np.array([-1, 1]), np.array([-1, 1]), np.full((2, 1), -1.0), np.full((2, 1), -1.0))
    assert m.abs_delta[1] == pytest.approx(2**-24, rel=0) and m.abs_delta[1] > 0


def test_each_samples_exact_stats_at_once_are_one_call_a_sample():
    """exact_stats_each (a rescore's --json, every sample's exact-KL and same-top statistics) gives
    exactly exact_stats([s]) a sample: mixed lengths, one position, a NaN KL, a NaN same-top, a
    sample stored without exact columns and an empty one."""
    from logprob_parity.results.rollout import Sample, exact_stats, exact_stats_each

    rng = np.random.default_rng(3)

    def sample(n: int, exact: bool = True, nan_kl: bool = False, nan_top: bool = False) -> Sample:
        kl, top = rng.random(n) * 1e-3, (rng.random(n) > 0.2).astype(np.float64)
        if nan_kl:
            kl[n // 2] = np.nan
        if nan_top:
            top[0] = np.nan
        return Sample(0, 0, (1,), tuple(range(n)), ("x",) * n, None, {}, {"kl_full": kl, "same_top": top} if exact else {})

    samples = [
        sample(5),
        sample(5),
        sample(1),
        sample(9, nan_kl=True),
        sample(5, nan_top=True),
        sample(4, exact=False),
        sample(0),
        sample(9),
        sample(2),
    ]
    got = exact_stats_each(samples)
    want = [exact_stats([s]) for s in samples]
    assert got == want  # the same numbers, bit for bit, and the same Nones
    assert got[0]["kl_full_mean"] is not None and got[3]["kl_full_mean"] is None and got[4]["same_top_p"] is None


def _summary_one_call(m):
    """The summary as one call a sequence computed it before `summarize_each` (1-D numpy, each key
    by itself): the reference the stacked rows must equal bit for bit."""
    from logprob_parity.results.metrics import exact_kl_stats, same_top_stats

    s = m.scored
    n = int(s.sum())
    if n == 0:
        return {k: (0 if k == "n_tokens" else None) for k in SUMMARY_KEYS}
    d, ad, pd_, kl = m.delta[s], m.abs_delta[s], m.prob_delta[s], m.kl_topk[s]
    p50, p95, p99 = np.percentile(ad, [50, 95, 99])
    ratio = np.exp(d)
    x, y = m.hf_prob[s], m.vllm_prob[s]
    pearson = None if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0 else float(np.corrcoef(x, y)[0, 1])
    dp = m.vllm_prob[s] - m.hf_prob[s]
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
        "pearson_prob": pearson,
        "seq_logprob_delta": float(d.sum()),
        "frac_ratio_outside_0.9_1.1": float(((ratio < 0.9) | (ratio > 1.1)).mean()),
        **exact_kl_stats(m.kl_full[s] if m.kl_full is not None else np.full(n, np.nan)),
        **same_top_stats(m.argmax_agree[s]),
        "dp_mean": float(dp.mean()),
        "dp_rms": float(np.sqrt(np.mean(dp**2))),
        "ppl_ratio": float(np.exp(-np.mean(d))),
    }


@pytest.mark.parametrize("with_kl_full", [True, False])
def test_summarize_each_equals_one_call_a_sequence_bit_for_bit(with_kl_full):
    """Mixed lengths, sequences with the same number of scored positions (stacked together), a
    sequence with none, unscored positions inside a sequence, a top-k KL that is NaN at some
    positions, an exact KL missing at one position of one sequence, and equal probabilities (no
    Pearson): every key of every sequence equals the 1-D reference exactly, and key order too."""
    from logprob_parity.results.metrics import summarize_each

    rng = np.random.default_rng(7)
    lengths = [5, 9, 9, 1, 9, 30, 2, 17, 9]
    total = sum(lengths)
    lh, lv = np.log(rng.uniform(0.01, 1, total)), np.log(rng.uniform(0.01, 1, total))
    starts = np.cumsum([0, *lengths[:-1]])
    lh[starts] = NAN
    lv[starts] = NAN
    lh[starts[7] + 4] = lv[starts[7] + 4] = NAN  # unscored inside a sequence
    lv[starts[6] + 1] = lh[starts[6] + 1]  # a 2-token sequence with one equal position
    top_h, top_v = rng.integers(0, 3, total), rng.integers(0, 3, total)
    vk, hk = np.log(rng.uniform(0.01, 0.5, (total, 3))), np.log(rng.uniform(0.01, 0.5, (total, 3)))
    vk[starts[5] + 3] = NAN  # the top-k KL is NaN at one position of the 30-token sequence
    kl_full = rng.uniform(0, 0.1, total) if with_kl_full else None
    if kl_full is not None:
        kl_full[starts[2] + 5] = NAN  # one sequence lacks its exact KL at one position
    m = token_metrics(lh, lv, top_h, top_v, vk, hk, kl_full)
    each = summarize_each(m, lengths)
    assert len(each) == len(lengths)
    for i, (lo, n) in enumerate(zip(starts, lengths)):
        part = type(m)(*(None if v is None else v[lo : lo + n] for v in (getattr(m, f) for f in m.__dataclass_fields__)))
        _assert_same_summary(each[i], _summary_one_call(part), f"sequence {i}")
    _assert_same_summary(summarize(m), _summary_one_call(m), "the whole batch")
    assert each[3]["n_tokens"] == 0 and each[3]["mean_abs_delta"] is None  # one token: nothing scored
    assert each[5]["mean_kl_topk"] is not None and math.isfinite(each[5]["mean_kl_topk"])
    assert (each[2]["kl_full_mean"] is None) and (each[1]["kl_full_mean"] is not None) == with_kl_full


def _assert_same_summary(got, want, where):
    assert list(got) == list(want) == list(SUMMARY_KEYS), where
    for k in SUMMARY_KEYS:
        a, b = got[k], want[k]
        same = (
            (a is None and b is None)
            or a == b
            or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
        )
        assert same, f"{where}, {k}: summarize_each {a!r} against one call a sequence {b!r}"
