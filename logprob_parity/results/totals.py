"""A rollout's summary metrics from its tokens read in parts, never all at once.

A rescore of 100,000 logged sequences keeps its scored tokens on disk (logprob_parity.analysis.rescore); its
summary (logprob_parity.results.offpolicy.mismatch_metrics per pair, and the exact KL's and same-top's
statistics, logprob_parity.results.metrics) is computed here from the parts, read twice:
1. sums, extremes, counts and per-sequence sums add up part by part; each quantile's value is
   placed in a bucket of its value's top bits (a histogram of the order-preserving key);
2. the values that fall in the buckets holding a wanted quantile's neighbours are gathered, and the
   quantile is numpy's linear one, computed from exactly the two values numpy would use.

So counts, extremes and quantiles equal the whole-array functions' exactly; sums, means and the
standard error differ only by the order of float additions (the tests hold them to 1e-12 relative).
Memory: the sums, a 2^20-bucket histogram a quantity (8 MiB), and the values of the wanted buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from logprob_parity.results.metrics import KL_PERCENTILES
from logprob_parity.results.offpolicy import MIS_BAND, SAFETY_BOUND, TIS_CAP, _empty

BUCKET_SHIFT = 44  # 64 - 20: a bucket is the sign, the exponent and 8 bits of the mantissa (1/256 of an octave)


def _keys(x: np.ndarray) -> np.ndarray:
    """float64 -> uint64 in the same order (negative values flipped whole, positive ones above them)."""
    bits = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def linear_quantile(n: int, q: float, kth: Callable[[int], float]) -> float:
    """numpy's default (linear) quantile q in [0, 1] of n values, given the k-th smallest by `kth`:
    the same index arithmetic and interpolation as numpy.quantile, so the same float."""
    qq = np.float64(q)
    virtual = (n - 1) * qq
    if virtual >= n - 1:
        return float(kth(n - 1))
    if virtual < 0:
        return float(kth(0))
    prev = np.floor(virtual)
    t = virtual - prev
    a, b = np.float64(kth(int(prev))), np.float64(kth(int(prev) + 1))
    diff = b - a
    return float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)


class Quantiles:
    """Exact linear quantiles of values seen in two passes (`count`, then `gather` the same values)."""

    def __init__(self, qs: Iterable[float]) -> None:
        self.qs = tuple(qs)
        self.n = 0
        self._hist = np.zeros(1 << (64 - BUCKET_SHIFT), dtype=np.int64)
        self._want: dict[int, list[np.ndarray]] | None = None
        self._before: dict[int, int] = {}

    def count(self, x: np.ndarray) -> None:
        if len(x):
            self.n += len(x)
            self._hist += np.bincount((_keys(x) >> np.uint64(BUCKET_SHIFT)).astype(np.int64), minlength=len(self._hist))

    def _ranks(self) -> set[int]:
        out: set[int] = set()
        for q in self.qs:
            linear_quantile(self.n, q, lambda k: out.add(k) or 0.0)  # the order statistics numpy reads
        return out

    def gather(self, x: np.ndarray) -> None:
        if self._want is None:
            cum = np.cumsum(self._hist)
            buckets = {int(np.searchsorted(cum, r, side="right")) for r in self._ranks()}
            self._want = {b: [] for b in buckets}
            self._before = {b: int(cum[b - 1]) if b else 0 for b in buckets}
        if len(x):
            b = (_keys(x) >> np.uint64(BUCKET_SHIFT)).astype(np.int64)
            for w, got in self._want.items():
                hit = x[b == w]
                if len(hit):
                    got.append(np.asarray(hit, dtype=np.float64))

    def values(self) -> list[float | None]:
        if not self.n:
            return [None] * len(self.qs)
        if self._want is None:
            self.gather(np.zeros(0))
        cum = np.cumsum(self._hist)
        sorted_ = {b: np.sort(np.concatenate(v)) if v else np.zeros(0) for b, v in self._want.items()}  # type: ignore[union-attr]

        def kth(k: int) -> float:
            b = int(np.searchsorted(cum, k, side="right"))
            return float(sorted_[b][k - self._before[b]])

        return [linear_quantile(self.n, q, kth) for q in self.qs]


class _Moments:
    """Count, mean and sum of squared deviations merged part by part (Chan et al.), for a standard
    deviation without the cancellation of Σx² − n·mean²."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        if not len(x):
            return
        n, mean = len(x), float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        d, total = mean - self.mean, self.n + n
        self.mean += d * n / total
        self.m2 += m2 + d * d * self.n * n / total
        self.n = total


class PairTotals:
    """mismatch_metrics of one pair over parts of whole sequences."""

    _SUMS = (
        "abs",
        "delta",
        "k2",
        "k3",
        "rho",
        "rho2",
        "out1",
        "out2",
        "exp_abs",
        "tis",
        "mis",
        "dp",
        "dp2",
        "chi2_seq",
        "seq_log",
        "ppl_ratio",
        "training_ppl",
        "rollout_ppl",
    )

    def __init__(self, tis_cap: float = TIS_CAP, mis_band: tuple[float, float] = MIS_BAND) -> None:
        self.tis_cap, self.mis_band = tis_cap, mis_band
        self.n_tokens = self.n_seq = 0
        self.sums = dict.fromkeys(self._SUMS, 0.0)
        self.ext = {"max_abs": -np.inf, "rho_min": np.inf, "rho_max": -np.inf, "seq_min": np.inf, "seq_max": -np.inf}
        self.p99 = Quantiles((0.99,))

    def add(self, lr: np.ndarray, lt: np.ndarray, lengths: np.ndarray) -> None:
        """Pass 1: the tokens of whole sequences, `lengths` tokens each (sequences without tokens are left out)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        lengths = lengths[lengths > 0]
        if not len(lr):
            return
        delta = lr - lt
        log_rho = -delta
        clipped = np.clip(log_rho, -SAFETY_BOUND, SAFETY_BOUND)
        rho = np.exp(clipped)
        ad = np.abs(delta)
        dp = np.exp(lr) - np.exp(lt)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        seq_log = np.add.reduceat(lt - lr, starts)
        mean_r, mean_t = np.add.reduceat(lr, starts) / lengths, np.add.reduceat(lt, starts) / lengths
        s = self.sums
        for k, v in (
            ("abs", ad),
            ("delta", delta),
            ("k2", 0.5 * log_rho**2),
            ("k3", rho - 1.0 - clipped),
            ("rho", rho),
            ("rho2", rho**2),
            ("out1", (rho < 0.8) | (rho > 1.25)),
            ("out2", (rho < 0.5) | (rho > 2.0)),
            ("exp_abs", np.exp(ad)),
            ("tis", rho > self.tis_cap),
            ("mis", (rho < self.mis_band[0]) | (rho > self.mis_band[1])),
            ("dp", dp),
            ("dp2", dp**2),
            ("chi2_seq", np.exp(2.0 * np.clip(seq_log, -SAFETY_BOUND, SAFETY_BOUND))),
            ("seq_log", seq_log),
            ("ppl_ratio", np.exp(mean_r - mean_t)),
            ("training_ppl", np.exp(-mean_t)),
            ("rollout_ppl", np.exp(-mean_r)),
        ):
            s[k] += float(np.sum(v, dtype=np.float64))
        e = self.ext
        e["max_abs"] = max(e["max_abs"], float(ad.max()))
        e["rho_min"], e["rho_max"] = min(e["rho_min"], float(rho.min())), max(e["rho_max"], float(rho.max()))
        e["seq_min"], e["seq_max"] = min(e["seq_min"], float(seq_log.min())), max(e["seq_max"], float(seq_log.max()))
        self.n_tokens += len(lr)
        self.n_seq += len(lengths)
        self.p99.count(ad)

    def gather(self, lr: np.ndarray, lt: np.ndarray) -> None:
        """Pass 2: the same tokens again, for the exact p99 |Δ|."""
        self.p99.gather(np.abs(lr - lt))

    def result(self) -> dict[str, float | int | None]:
        out = _empty(self.n_seq, self.n_tokens, self.tis_cap, self.mis_band)
        if not self.n_tokens:
            return out
        n, k, s, e = self.n_tokens, self.n_seq, self.sums, self.ext
        (p99,) = self.p99.values()
        out.update(
            {
                "mean_abs_delta": s["abs"] / n,
                "max_abs_delta": e["max_abs"],
                "p99_abs_delta": p99,
                "mean_delta": s["delta"] / n,
                "kl": s["delta"] / n,
                "k2_kl": s["k2"] / n,
                "k3_kl": s["k3"] / n,
                "chi2_token": s["rho2"] / n - 1.0,
                "chi2_seq": s["chi2_seq"] / k - 1.0,
                "rollout_is_mean": s["rho"] / n,
                "rollout_is_min": e["rho_min"],
                "rollout_is_max": e["rho_max"],
                "rollout_is_eff_sample_size": s["rho"] ** 2 / (n * s["rho2"]),
                "frac_ratio_outside_0.8_1.25": s["out1"] / n,
                "frac_ratio_outside_0.5_2": s["out2"] / n,
                "seq_log_ratio_mean": s["seq_log"] / k,
                "seq_log_ratio_min": e["seq_min"],
                "seq_log_ratio_max": e["seq_max"],
                "ppl_ratio": s["ppl_ratio"] / k,
                "training_ppl": s["training_ppl"] / k,
                "rollout_ppl": s["rollout_ppl"] / k,
                "token_mult_prob_error": s["exp_abs"] / n,
                "tis_clip_fraction": s["tis"] / n,
                "mis_mask_fraction": s["mis"] / n,
                "dp_mean": s["dp"] / n,
                "dp_rms": float(np.sqrt(s["dp2"] / n)),
            }
        )
        return out


class ExactTotals:
    """logprob_parity.results.rollout.exact_stats (the exact KL's mean ± error, max and percentiles; the
    same-top share ± error) over parts: None where any token lacks its value, as there."""

    def __init__(self, sampled: bool = False) -> None:
        self.sampled = sampled  # the exact KL exists on a sample of positions (engines in turn): of those
        self.kl = _Moments()
        self.kl_max = -np.inf
        self.kl_missing = False
        self.same_n = self.same_yes = 0
        self.same_missing = False
        self.q = Quantiles(q / 100 for _, q in KL_PERCENTILES)

    def add(self, kl: np.ndarray, same: np.ndarray) -> None:
        if self.sampled:
            kl = kl[np.isfinite(kl)]
        if not np.isfinite(kl).all():
            self.kl_missing = True
        elif len(kl):
            self.kl.add(kl)
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.q.count(kl)
        if not np.isfinite(same).all():
            self.same_missing = True
        self.same_n += len(same)
        self.same_yes += int((same > 0.5).sum())

    def gather(self, kl: np.ndarray) -> None:
        if self.sampled:
            kl = kl[np.isfinite(kl)]
        if not self.kl_missing:
            self.q.gather(kl)

    def result(self) -> dict[str, float | None]:
        from logprob_parity.results.metrics import FULL_KL_KEYS, same_top_stats_rows

        out: dict[str, float | None] = dict.fromkeys((*FULL_KL_KEYS, "kl_full_mean_err"))
        n = self.kl.n
        if n and not self.kl_missing:
            out.update(kl_full_mean=self.kl.mean, kl_full_max=self.kl_max)
            if n > 1:
                out["kl_full_mean_err"] = float(np.sqrt(self.kl.m2 / (n - 1)) / np.sqrt(n))
            for (key, _), v in zip(KL_PERCENTILES, self.q.values()):
                out[f"kl_full_{key}"] = v
        same_n = 0 if self.same_missing else self.same_n
        if same_n:
            share = self.same_yes / same_n
            out["same_top_p"] = share
            out["same_top_p_err"] = float(np.sqrt(share * (1 - share) / (same_n - 1))) if same_n > 1 else None
        else:
            out.update(same_top_stats_rows(np.zeros((1, 0), dtype=bool))[0])
        return out


def streamed_summary(
    parts: Callable[[], Iterator[dict[str, np.ndarray]]],
    pairs: dict[str, tuple[str, str, str]],
    main_exact: str,
    exact: ExactTotals | None = None,
) -> dict[str, dict[str, Any]]:
    """{pair: mismatch metrics} (and the exact statistics on `main_exact`) of the parts `parts()`
    yields, twice: each a dict of token columns (float64, whole sequences) and "lengths" [sequences].
    exact: the caller's own totals of the exact KL (a sampled one, whose count it reads after)."""
    totals = {pair: PairTotals() for pair in pairs}
    exact = ExactTotals() if exact is None else exact
    for part in parts():
        for pair, (a, b, _) in pairs.items():
            totals[pair].add(part[a], part[b], part["lengths"])
        exact.add(part["kl_full"], part["same_top"])
    for part in parts():
        for pair, (a, b, _) in pairs.items():
            totals[pair].gather(part[a], part[b])
        exact.gather(part["kl_full"])
    out: dict[str, dict[str, Any]] = {pair: t.result() for pair, t in totals.items()}
    out[main_exact].update(exact.result())
    return out
