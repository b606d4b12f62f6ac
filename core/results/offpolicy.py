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

from collections.abc import Sequence

import numpy as np

SAFETY_BOUND = 20.0
TIS_CAP = 2.0  # verl's rollout_is_threshold default
MIS_BAND = (0.5, 2.0)  # IcePop-style mask band
RATIO_BANDS = ((0.8, 1.25), (0.5, 2.0))
# log ρ is clamped to ±20 before exponentiating (verl's SAFETY_BOUND), so one wild token cannot
# overflow the ratio statistics; Δ and the KL estimators k1/k2 use the unclamped values.

METRIC_KEYS = (
    "n_tokens", "n_sequences", "mean_abs_delta", "max_abs_delta", "p99_abs_delta", "mean_delta",
    "kl", "k2_kl", "k3_kl", "chi2_token", "chi2_seq",
    "rollout_is_mean", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
    "frac_ratio_outside_0.8_1.25", "frac_ratio_outside_0.5_2",
    "seq_log_ratio_mean", "seq_log_ratio_min", "seq_log_ratio_max",
    "ppl_ratio", "training_ppl", "rollout_ppl", "token_mult_prob_error",
    "tis_clip_fraction", "mis_mask_fraction", "dp_mean", "dp_rms",
)


def token_deltas(rollout: np.ndarray, trainer: np.ndarray) -> np.ndarray:
    """Δ = l_rollout − l_trainer per token (float64)."""
    return np.asarray(rollout, dtype=np.float64) - np.asarray(trainer, dtype=np.float64)


def mismatch_metrics(rollout: Sequence[np.ndarray], trainer: Sequence[np.ndarray], tis_cap: float = TIS_CAP,
                     mis_band: tuple[float, float] = MIS_BAND) -> dict[str, float | int | None]:
    """The metrics of METRIC_KEYS over sequences (one array per sampled completion, same lengths
    on both sides). Empty input gives counts of 0 and None elsewhere."""
    pairs = [(np.asarray(r, dtype=np.float64), np.asarray(t, dtype=np.float64)) for r, t in zip(rollout, trainer) if len(r)]
    out: dict[str, float | int | None] = dict.fromkeys(METRIC_KEYS)
    out["n_sequences"] = len(pairs)
    out["n_tokens"] = int(sum(len(r) for r, _ in pairs))
    out["tis_cap"], out["mis_band"] = tis_cap, list(mis_band)
    if not pairs:
        return out
    for r, t in pairs:
        if r.shape != t.shape:
            raise ValueError(f"rollout and trainer logprobs differ in length: {r.shape} != {t.shape}")
    lr = np.concatenate([r for r, _ in pairs])
    lt = np.concatenate([t for _, t in pairs])
    delta = lr - lt
    log_rho = -delta
    rho = np.exp(np.clip(log_rho, -SAFETY_BOUND, SAFETY_BOUND))
    ad = np.abs(delta)
    seq_log = np.array([float(np.sum(t - r)) for r, t in pairs])
    mean_r = np.array([r.mean() for r, _ in pairs])
    mean_t = np.array([t.mean() for _, t in pairs])
    out.update({
        "mean_abs_delta": float(ad.mean()),
        "max_abs_delta": float(ad.max()),
        "p99_abs_delta": float(np.quantile(ad, 0.99)),
        "mean_delta": float(delta.mean()),
        "kl": float(delta.mean()),
        "k2_kl": float(np.mean(0.5 * log_rho**2)),
        "k3_kl": float(np.mean(rho - 1.0 - np.clip(log_rho, -SAFETY_BOUND, SAFETY_BOUND))),
        "chi2_token": float(np.mean(rho**2) - 1.0),
        "chi2_seq": float(np.mean(np.exp(2.0 * np.clip(seq_log, -SAFETY_BOUND, SAFETY_BOUND))) - 1.0),
        "rollout_is_mean": float(rho.mean()),
        "rollout_is_min": float(rho.min()),
        "rollout_is_max": float(rho.max()),
        "rollout_is_eff_sample_size": float(rho.sum() ** 2 / (len(rho) * np.sum(rho**2))),
        "frac_ratio_outside_0.8_1.25": float(np.mean((rho < 0.8) | (rho > 1.25))),
        "frac_ratio_outside_0.5_2": float(np.mean((rho < 0.5) | (rho > 2.0))),
        "seq_log_ratio_mean": float(seq_log.mean()),
        "seq_log_ratio_min": float(seq_log.min()),
        "seq_log_ratio_max": float(seq_log.max()),
        "ppl_ratio": float(np.mean(np.exp(mean_r - mean_t))),
        "training_ppl": float(np.mean(np.exp(-mean_t))),
        "rollout_ppl": float(np.mean(np.exp(-mean_r))),
        "token_mult_prob_error": float(np.mean(np.exp(ad))),
        "tis_clip_fraction": float(np.mean(rho > tis_cap)),
        "mis_mask_fraction": float(np.mean((rho < mis_band[0]) | (rho > mis_band[1]))),
        "dp_mean": float(np.mean(np.exp(lr) - np.exp(lt))),
        "dp_rms": float(np.sqrt(np.mean((np.exp(lr) - np.exp(lt)) ** 2))),
    })
    return out


def floor_stats(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict[str, float | int | None]:
    """Mean and max |a − b| over all tokens of paired arrays (a noise floor)."""
    d = [np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)) for x, y in zip(a, b) if len(x)]
    if not d:
        return {"mean": None, "max": None, "n": 0}
    allv = np.concatenate(d)
    return {"mean": float(allv.mean()), "max": float(allv.max()), "n": int(allv.size)}
