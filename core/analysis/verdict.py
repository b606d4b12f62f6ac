"""A plain-language verdict for people who do not read the numbers, with the thresholds it uses named."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# vLLM's own tests accept logprob differences of 1e-2 (tight) to 2e-2 (loose) between engines.
VLLM_TEST_TOL = (1e-2, 2e-2)
# RL frameworks flag a trainer/rollout mismatch when mean |Δ logp| exceeds 0.1.
RL_MEAN_ABS = 0.1
# Importance-ratio bands: a token whose probability differs by more than 2x (5x) between engines.
RATIO_BANDS = (2.0, 5.0)


@dataclass(frozen=True)
class Verdict:
    level: str  # "match", "close", "differs"
    headline: str
    reasons: tuple[str, ...]
    thresholds: tuple[str, ...] = (
        f"vLLM's test tolerance: max |Δ logp| <= {VLLM_TEST_TOL[0]:g} (tight) / {VLLM_TEST_TOL[1]:g} (loose)",
        f"RL frameworks: mean |Δ logp| <= {RL_MEAN_ABS:g}",
        f"importance-ratio bands: {RATIO_BANDS[0]:g}x and {RATIO_BANDS[1]:g}x (|Δ logp| = ln {RATIO_BANDS[0]:g}, ln {RATIO_BANDS[1]:g})",
    )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(summary: dict[str, Any], dtype: str, noise_ratio: float | None = None) -> Verdict:
    mx, mean = summary.get("max_abs_delta"), summary.get("mean_abs_delta")
    if mx is None or mean is None:
        return Verdict("differs", f"{dtype}: nothing was scored", ())
    reasons = []
    if mx <= VLLM_TEST_TOL[0]:
        reasons.append(f"Every token is within vLLM's own test tolerance (largest gap {mx:.2g} <= {VLLM_TEST_TOL[0]:g} nats).")
    elif mx <= VLLM_TEST_TOL[1]:
        reasons.append(f"Every token is within vLLM's looser test tolerance (largest gap {mx:.2g} <= {VLLM_TEST_TOL[1]:g}).")
    else:
        reasons.append(f"Some tokens differ by more than vLLM's own tests allow (largest gap {mx:.2g} > {VLLM_TEST_TOL[1]:g} nats).")
    ok_rl = mean <= RL_MEAN_ABS
    reasons.append(
        f"On average the engines differ by {mean:.2g} nats per token: "
        + ("within" if ok_rl else "above")
        + f" the {RL_MEAN_ABS:g} that RL frameworks accept between trainer and rollout."
    )
    worst_ratio = math.exp(mx)
    if worst_ratio > RATIO_BANDS[1]:
        reasons.append(f"At least one token's probability differs by more than {RATIO_BANDS[1]:g}x ({worst_ratio:.3g}x).")
    elif worst_ratio > RATIO_BANDS[0]:
        reasons.append(f"At least one token's probability differs by more than {RATIO_BANDS[0]:g}x ({worst_ratio:.3g}x).")
    else:
        reasons.append(f"No token's probability differs by more than {RATIO_BANDS[0]:g}x (worst {worst_ratio:.4g}x).")
    agree = summary.get("argmax_agreement")
    if agree is not None and agree < 1:
        reasons.append(f"The engines' most likely next token differs at {1 - agree:.1%} of positions: greedy outputs can diverge.")
    if noise_ratio is not None:
        reasons.append(f"The vLLM–HF gap is {noise_ratio:.2g}x HF's own noise (the largest of: batched with other prompts, left or right padding, another attention implementation).")
    if mx <= VLLM_TEST_TOL[1]:
        level, head = "match", f"{dtype}: vLLM and HF agree (within vLLM's own test tolerance)."
    elif ok_rl and worst_ratio <= RATIO_BANDS[1]:
        level, head = "close", f"{dtype}: small differences, usually harmless (mean {mean:.2g} nats/token)."
    else:
        level, head = "differs", f"{dtype}: the engines differ enough to change results (mean {mean:.2g}, max {mx:.2g} nats)."
    return Verdict(level, head, tuple(reasons))


def run_verdicts(runs: list[Any], diagnostics: Any = None) -> list[Verdict]:
    """The verdict of each run, using the stored diagnostics built on it when there are any.
    The one place the Compare page, the CLI and the HTML report get their verdicts from."""
    ids = {r.run_id for r in runs}
    ratios = {}
    if diagnostics is not None:
        ratios = {d: o.ratio_to_hf_noise for d, o in diagnostics.dtypes.items() if o.run_id in ids}
    return [verdict(r.summary, r.dtype, ratios.get(r.dtype)) for r in runs]
