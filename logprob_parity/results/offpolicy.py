"""Trainer/rollout mismatch metrics, under the names RL frameworks log them.

Inputs are per-token log probabilities of the same sampled tokens from two sides: the *rollout*
side (what sampled them: vLLM's decode path) and the *trainer* side (what rescored them: HF
teacher-forced, or vLLM's prefill). Everything is float64 and nothing is rounded before comparing.

Definitions (README, "Rollout metrics"), with log ρ = l_trainer − l_rollout per token:
- delta Δ = l_rollout − l_trainer; `mean_abs_delta` is TRL's `sampling_logp_difference` mean and
  slime's `train_rollout_logprob_abs_diff`.
- k1 `kl` = mean(l_rollout − l_trainer) (verl's `rollout_corr/kl`), `k2_kl` = mean(½ (log ρ)²),
  `k3_kl` = mean(ρ − 1 − log ρ) (verl), all estimates of KL(rollout ‖ trainer) on rollout samples.
- `chi2_token` = mean(ρ²) − 1; `chi2_seq` = mean over sequences of exp(2 Σ log ρ) − 1 (verl).
- importance ratio ρ: `rollout_is_mean/min/max`; `rollout_is_eff_sample_size` = (Σρ)² / (N Σρ²),
  the effective sample size as a share of N (verl's normalised form, here without its clamp).
- `frac_ratio_outside_0.8_1.25`, `frac_ratio_outside_0.5_2`: tokens whose ρ leaves the band.
- `seq_log_ratio_*`: Σ log ρ per sequence; `ppl_ratio` = mean over sequences of
  exp(mean l_rollout − mean l_trainer) = trainer ppl / rollout ppl (verl); `training_ppl`,
  `rollout_ppl`: mean over sequences of exp(−mean l).
- `token_mult_prob_error` = mean exp(|Δ|) (NeMo-RL: 1.0 is a perfect match).
- `dp_mean`, `dp_rms`: Δp = p_rollout − p_trainer of the token, its mean and RMS (llama.cpp's names).
- `tis_clip_fraction`: tokens whose ρ > the TIS cap (truncated importance sampling clips them);
  `mis_mask_fraction`: tokens whose ρ leaves the MIS/IcePop band [lo, hi] (they are masked).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

SAFETY_BOUND = 20.0
TIS_CAP = 2.0  # verl's rollout_is_threshold default
MIS_BAND = (0.5, 2.0)  # IcePop-style mask band
RATIO_BANDS = ((0.8, 1.25), (0.5, 2.0))
# log ρ is clamped to ±20 before exponentiating (verl's SAFETY_BOUND), so one wild token cannot
# overflow the ratio statistics; Δ and the KL estimators k1/k2 use the unclamped values.

METRIC_KEYS = (
    "n_tokens",
    "n_sequences",
    "mean_abs_delta",
    "max_abs_delta",
    "p99_abs_delta",
    "mean_delta",
    "kl",
    "k2_kl",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "rollout_is_mean",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_eff_sample_size",
    "frac_ratio_outside_0.8_1.25",
    "frac_ratio_outside_0.5_2",
    "seq_log_ratio_mean",
    "seq_log_ratio_min",
    "seq_log_ratio_max",
    "ppl_ratio",
    "training_ppl",
    "rollout_ppl",
    "token_mult_prob_error",
    "tis_clip_fraction",
    "mis_mask_fraction",
    "dp_mean",
    "dp_rms",
)


def token_deltas(rollout: np.ndarray, trainer: np.ndarray) -> np.ndarray:
    """Δ = l_rollout − l_trainer per token (float64)."""
    return np.asarray(rollout, dtype=np.float64) - np.asarray(trainer, dtype=np.float64)


def mismatch_metrics(
    rollout: Sequence[np.ndarray],
    trainer: Sequence[np.ndarray],
    tis_cap: float = TIS_CAP,
    mis_band: tuple[float, float] = MIS_BAND,
) -> dict[str, float | int | None]:
    """The metrics of METRIC_KEYS over sequences (one array per sampled completion, same lengths
    on both sides). Empty input gives counts of 0 and None elsewhere."""
    pairs = [(np.asarray(r, dtype=np.float64), np.asarray(t, dtype=np.float64)) for r, t in zip(rollout, trainer) if len(r)]
    for r, t in pairs:
        if r.shape != t.shape:
            raise ValueError(f"rollout and trainer logprobs differ in length: {r.shape} != {t.shape}")
    out = _empty(len(pairs), int(sum(len(r) for r, _ in pairs)), tis_cap, mis_band)
    if not pairs:
        return out
    seq = lambda f: np.array([[f(r, t) for r, t in pairs]])  # noqa: E731 - [1, sequences]
    rows = _rows(
        np.concatenate([r for r, _ in pairs])[None],
        np.concatenate([t for _, t in pairs])[None],
        seq(lambda r, t: float(np.sum(t - r))),
        seq(lambda r, t: r.mean()),
        seq(lambda r, t: t.mean()),
        tis_cap,
        mis_band,
    )
    out.update({k: float(v[0]) for k, v in rows.items()})
    return out


def mismatch_metrics_each(
    rollout: Sequence[np.ndarray],
    trainer: Sequence[np.ndarray],
    tis_cap: float = TIS_CAP,
    mis_band: tuple[float, float] = MIS_BAND,
) -> list[dict[str, float | int | None]]:
    """[mismatch_metrics([r], [t]) for r, t in zip(rollout, trainer)], the same numbers computed for
    all sequences of one length at once: a rescore of 100,000 logged sequences writes each one's
    metrics into its --json, and one call a sequence took minutes."""
    rs = [np.asarray(r, dtype=np.float64) for r in rollout]
    ts = [np.asarray(t, dtype=np.float64) for t in trainer]
    out: list[dict[str, float | int | None]] = [_empty(0, 0, tis_cap, mis_band) for _ in rs]
    for r, t in zip(rs, ts):
        if r.shape != t.shape:
            raise ValueError(f"rollout and trainer logprobs differ in length: {r.shape} != {t.shape}")
    for n, idx in by_length(len(r) for r in rs).items():
        lr, lt = np.stack([rs[i] for i in idx]), np.stack([ts[i] for i in idx])  # [k, n]: row j is sequence idx[j]
        rows = _rows(
            lr, lt, np.sum(lt - lr, axis=1)[:, None], lr.mean(axis=1)[:, None], lt.mean(axis=1)[:, None], tis_cap, mis_band
        )
        cols = {k: v.tolist() for k, v in rows.items()}
        for j, i in enumerate(idx):
            out[i] = {**_empty(1, n, tis_cap, mis_band), **{k: v[j] for k, v in cols.items()}}
    return out


def by_length(lengths: Iterable[int]) -> dict[int, list[int]]:
    """Indices by length, leaving out length 0: the sequences whose arrays stack into one [k, n]
    block, so a statistic per sequence is one numpy call a length (and the same reduction, bit for
    bit, as one call a sequence)."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            out.setdefault(n, []).append(i)
    return out


def _empty(n_sequences: int, n_tokens: int, tis_cap: float, mis_band: tuple[float, float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = dict.fromkeys(METRIC_KEYS)
    out["n_sequences"], out["n_tokens"] = n_sequences, n_tokens
    out["tis_cap"], out["mis_band"] = tis_cap, list(mis_band)  # type: ignore[assignment]
    return out


def _rows(
    lr: np.ndarray,
    lt: np.ndarray,
    seq_log: np.ndarray,
    mean_r: np.ndarray,
    mean_t: np.ndarray,
    tis_cap: float,
    mis_band: tuple[float, float],
) -> dict[str, np.ndarray]:
    """The metrics (but the counts) of each row: lr, lt [rows, tokens] are the two sides' logprobs,
    seq_log, mean_r, mean_t [rows, sequences] each sequence's Σ log ρ and mean logprobs. One row is a
    whole set (mismatch_metrics) or one sequence (mismatch_metrics_each): one definition for both."""
    delta = lr - lt
    log_rho = -delta
    rho = np.exp(np.clip(log_rho, -SAFETY_BOUND, SAFETY_BOUND))
    ad = np.abs(delta)
    n = lr.shape[1]
    dp = np.exp(lr) - np.exp(lt)
    return {
        "mean_abs_delta": ad.mean(axis=1),
        "max_abs_delta": ad.max(axis=1),
        "p99_abs_delta": np.quantile(ad, 0.99, axis=1),
        "mean_delta": delta.mean(axis=1),
        "kl": delta.mean(axis=1),
        "k2_kl": np.mean(0.5 * log_rho**2, axis=1),
        "k3_kl": np.mean(rho - 1.0 - np.clip(log_rho, -SAFETY_BOUND, SAFETY_BOUND), axis=1),
        "chi2_token": np.mean(rho**2, axis=1) - 1.0,
        "chi2_seq": np.mean(np.exp(2.0 * np.clip(seq_log, -SAFETY_BOUND, SAFETY_BOUND)), axis=1) - 1.0,
        "rollout_is_mean": rho.mean(axis=1),
        "rollout_is_min": rho.min(axis=1),
        "rollout_is_max": rho.max(axis=1),
        "rollout_is_eff_sample_size": rho.sum(axis=1) ** 2 / (n * np.sum(rho**2, axis=1)),
        "frac_ratio_outside_0.8_1.25": np.mean((rho < 0.8) | (rho > 1.25), axis=1),
        "frac_ratio_outside_0.5_2": np.mean((rho < 0.5) | (rho > 2.0), axis=1),
        "seq_log_ratio_mean": seq_log.mean(axis=1),
        "seq_log_ratio_min": seq_log.min(axis=1),
        "seq_log_ratio_max": seq_log.max(axis=1),
        "ppl_ratio": np.mean(np.exp(mean_r - mean_t), axis=1),
        "training_ppl": np.mean(np.exp(-mean_t), axis=1),
        "rollout_ppl": np.mean(np.exp(-mean_r), axis=1),
        "token_mult_prob_error": np.mean(np.exp(ad), axis=1),
        "tis_clip_fraction": np.mean(rho > tis_cap, axis=1),
        "mis_mask_fraction": np.mean((rho < mis_band[0]) | (rho > mis_band[1]), axis=1),
        "dp_mean": np.mean(dp, axis=1),
        "dp_rms": np.sqrt(np.mean(dp**2, axis=1)),
    }


def floor_stats(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict[str, float | int | None]:
    """Mean and max |a − b| over all tokens of paired arrays (a noise floor)."""
    d = [np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)) for x, y in zip(a, b) if len(x)]
    if not d:
        return {"mean": None, "max": None, "n": 0}
    allv = np.concatenate(d)
    return {"mean": float(allv.mean()), "max": float(allv.max()), "n": int(allv.size)}
