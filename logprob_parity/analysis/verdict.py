"""The one verdict: a plain-language judgement of a comparison that uses all the evidence there is.

Why one function: the CLI, the Compare page, the Diagnostics page and the HTML report each wrote
their own, and they drifted (a gap 345x HF's own noise, removed by one knob, still read "MATCH").
`verdict(summary, dtype, evidence)` weighs, in this order:

1. vLLM's own test tolerance on the largest per-token gap, and the RL trainer/rollout bound on the mean;
2. the noise ratio (the gap against HF's disagreement with itself): a gap within tolerance but far
   above the noise is *small but systematic*, not a match;
3. the float64 reference: which engine is closer to the truth;
4. knob attribution: which setting removes most of the gap.

Everything it says names a number a reader can check in the tables beside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

# vLLM's own tests accept logprob differences of 1e-2 (tight) to 2e-2 (loose) between engines.
VLLM_TEST_TOL = (1e-2, 2e-2)
# RL trainers (verl, TRL) flag a trainer/rollout mismatch when mean |Δ logp| exceeds 0.1.
RL_MEAN_ABS = 0.1
# Importance-ratio bands: a token whose probability differs by more than 2x (5x) between engines.
RATIO_BANDS = (2.0, 5.0)
# A gap this many times HF's own noise is systematic: it is not explained by batching, padding or kernels.
SYSTEMATIC_NOISE_RATIO = 10.0
# One engine is "closer to the reference" when the other is this many times farther from it.
REFERENCE_SIDE_RATIO = 2.0
# A knob "removes the gap" when changing it alone cuts the mean gap by at least this share.
KNOB_SHARE = 0.5

# The reason that opens with these words names tokens beyond the tolerance; a page adds where they are.
BEYOND_WORDS = "Some tokens differ by more than vLLM's own tests allow"

LEVELS = ("match", "unmeasured", "systematic", "close", "differs")  # from best to worst
LEVEL_WORDS = {
    "match": "Match",
    "unmeasured": "Within tolerance, noise not yet measured",
    "systematic": "Small but systematic",
    "close": "Close",
    "differs": "Differs",
}

THRESHOLDS = (
    f"vLLM's test tolerance: largest |Δ logp| <= {VLLM_TEST_TOL[0]:g} (tight) / {VLLM_TEST_TOL[1]:g} (loose)",
    f"RL trainers: mean |Δ logp| <= {RL_MEAN_ABS:g}",
    f"systematic: the gap is more than {SYSTEMATIC_NOISE_RATIO:g}x HF's own noise",
    f"probability-ratio bands: {RATIO_BANDS[0]:g}x and {RATIO_BANDS[1]:g}x",
)


@dataclass(frozen=True)
class Evidence:
    """What diagnostics add to a comparison's summary; every field is optional."""

    noise_ratio: float | None = None  # mean gap / HF's own noise floor
    hf_noise: float | None = None  # HF's own noise floor (mean |Δ logp|)
    vllm_to_ref: float | None = None  # mean |vLLM - float64 reference|
    hf_to_ref: float | None = None  # mean |HF - float64 reference|
    knob: str | None = None  # the setting whose change cuts the gap most
    knob_share: float | None = None  # share of the mean gap that setting removes (0..1)
    floor_words: str | None = None  # the variation that set HF's floor, in words (logprob_parity.analysis.floors)


@dataclass(frozen=True)
class Verdict:
    level: str  # one of LEVELS
    headline: str
    reasons: tuple[str, ...]
    thresholds: tuple[str, ...] = THRESHOLDS

    @property
    def title(self) -> str:
        return LEVEL_WORDS.get(self.level, self.level)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percent_change(abs_delta: float) -> str:
    """|Δ logp| as the change in a probability a reader can picture: 0.01 -> '1.0%'."""
    pct = math.expm1(abs_delta) * 100
    if pct >= 100:
        return f"{math.exp(abs_delta):.3g}x"
    return f"{pct:.2g}%" if pct >= 0.01 else "under 0.01%"


def verdict(summary: dict[str, Any], dtype: str, evidence: Evidence | float | None = None) -> Verdict:
    """The verdict of one dtype. `evidence` may be a bare noise ratio (older callers) or an Evidence."""
    ev = Evidence(noise_ratio=evidence) if isinstance(evidence, (int, float)) else (evidence or Evidence())
    mx, mean = summary.get("max_abs_delta"), summary.get("mean_abs_delta")
    if mx is None or mean is None:
        return Verdict("differs", f"{dtype}: nothing was scored, so nothing can be said.", ())
    reasons = []
    floor = ev.hf_noise
    # a token within HF's own floor is never "a problem", even where the floor lies above vLLM's
    # tolerance (bfloat16 can): the token view paints it the same way (logprob_parity.present.render)
    beyond = mx > VLLM_TEST_TOL[1] and not (floor is not None and mx <= floor)
    if mx <= VLLM_TEST_TOL[0]:
        reasons.append(
            f"Every token is within vLLM's own test tolerance: the largest gap is {mx:.2g} (a change of {percent_change(mx)} "
            f"in one token's probability), at most {VLLM_TEST_TOL[0]:g} allowed."
        )
    elif mx <= VLLM_TEST_TOL[1]:
        reasons.append(
            f"Every token is within vLLM's looser test tolerance: the largest gap is {mx:.2g} "
            f"({percent_change(mx)} in probability), at most {VLLM_TEST_TOL[1]:g} allowed."
        )
    elif not beyond:
        reasons.append(
            f"The largest gap, {mx:.2g} ({percent_change(mx)} in probability), is above vLLM's test tolerance of "
            f"{VLLM_TEST_TOL[1]:g} but within HF's own noise floor of {floor:.2g}: HF moves as much against itself, "
            "so no token is counted a problem."
        )
    else:
        reasons.append(
            f"{BEYOND_WORDS}: the largest gap is {mx:.2g} ({percent_change(mx)} in probability), above {VLLM_TEST_TOL[1]:g}"
            + (f" and above HF's own noise floor of {floor:.2g}." if floor else ".")
        )
    ok_rl = mean <= RL_MEAN_ABS
    reasons.append(
        f"On average a token's probability differs by {percent_change(mean)} (mean |Δ logp| {mean:.2g}): "
        + ("within" if ok_rl else "above")
        + f" the {RL_MEAN_ABS:g} RL trainers accept between trainer and rollout."
    )
    worst_ratio = math.exp(mx)
    if worst_ratio > RATIO_BANDS[1]:
        reasons.append(f"At least one token's probability differs by more than {RATIO_BANDS[1]:g}x ({worst_ratio:.3g}x).")
    elif worst_ratio > RATIO_BANDS[0]:
        reasons.append(f"At least one token's probability differs by more than {RATIO_BANDS[0]:g}x ({worst_ratio:.3g}x).")
    agree = summary.get("argmax_agreement")
    if agree is not None and agree < 1:
        reasons.append(
            f"The engines' most likely next token differs at {1 - agree:.1%} of positions: generated text can diverge."
        )

    silent = ev.noise_ratio is None and ev.hf_noise == 0  # HF gave bit-identical values against itself
    systematic = (ev.noise_ratio is not None and ev.noise_ratio > SYSTEMATIC_NOISE_RATIO) or (silent and mean > 0)
    how = f" ({ev.floor_words})" if ev.floor_words else ""
    if silent:
        reasons.append(
            "HF gave identical values against itself under every variation measured"
            + (f" ({ev.floor_words})" if ev.floor_words else "")
            + ": its own noise measured 0, so "
            + ("any gap is above it: systematic." if mean > 0 else "and so is the gap.")
        )
    elif ev.noise_ratio is not None:
        if systematic:
            reasons.append(
                f"The gap is {ev.noise_ratio:.3g}x HF's own noise floor{how}: it is systematic, not what a trainer's "
                "own batching, padding or chunking does to it."
            )
        else:
            reasons.append(f"The gap is {ev.noise_ratio:.2g}x HF's own noise floor{how}: about what HF does to itself.")
    side, side_clause = _reference_words(ev)
    if side:
        reasons.append(side)
    fix = None
    if ev.knob and ev.knob_share is not None and ev.knob_share >= KNOB_SHARE:
        fix = f"{ev.knob} removes {ev.knob_share:.1%} of the gap"
        reasons.append(f"Changing one setting, {ev.knob}, removes {ev.knob_share:.1%} of the mean gap.")

    if mean > RL_MEAN_ABS or worst_ratio > RATIO_BANDS[1]:
        level = "differs"
        head = f"{dtype}: the engines differ enough to change results (on average {percent_change(mean)} per token, worst {worst_ratio:.3g}x)."
    elif beyond:
        level = "close"
        head = f"{dtype}: close on average ({percent_change(mean)} per token), but some tokens are beyond vLLM's test tolerance."
    elif systematic:
        level = "systematic"
        times = "above HF's own noise of 0" if silent else f"{ev.noise_ratio:.3g}x HF's own noise"
        head = f"{dtype}: within vLLM's test tolerance, but systematic: {times}."
    elif ev.noise_ratio is None and ev.hf_noise is None:
        level = "unmeasured"
        head = (
            f"{dtype}: within vLLM's own test tolerance; HF's own noise is not yet measured, so whether the gap is "
            "more than noise is not known (Diagnostics measures it)."
        )
        reasons.append(
            "HF's own noise floor (HF against itself when its micro-batch, padding, packing or chunking changes) "
            "was not measured for this comparison: the gap is not yet judged against it."
        )
    else:
        level = "match"
        head = f"{dtype}: vLLM and HF agree, within vLLM's own test tolerance and HF's own noise."
    extra = [s for s in (side_clause, fix) if s]
    if extra and level != "match":
        head += " " + "; ".join(extra) + "."
    return Verdict(level, head, tuple(reasons))


def _ref_ratio(ev: Evidence) -> float | None:
    if ev.vllm_to_ref is None or ev.hf_to_ref is None:
        return None
    if ev.hf_to_ref == 0:
        return math.inf if ev.vllm_to_ref > 0 else 1.0
    return ev.vllm_to_ref / ev.hf_to_ref


def _reference_words(ev: Evidence) -> tuple[str | None, str | None]:
    """(reason, headline clause) about which engine is closer to the float64 reference; the clause
    only when one side is at least REFERENCE_SIDE_RATIO times closer."""
    r = _ref_ratio(ev)
    if r is None:
        return None, None
    for far, near, x, far_d, near_d in (
        ("vLLM", "HF", r, ev.vllm_to_ref, ev.hf_to_ref),
        ("HF", "vLLM", 1 / r if r else math.inf, ev.hf_to_ref, ev.vllm_to_ref),
    ):
        if x >= REFERENCE_SIDE_RATIO:
            return (
                f"Against a float64 reference, {far} is {x:.3g}x farther from it than {near} "
                f"({far_d:.2e} against {near_d:.2e}): the gap comes from {far}'s side.",
                f"{far} is {x:.3g}x farther from the float64 reference than {near}",
            )
    return f"Both engines are about as far from a float64 reference (vLLM {ev.vllm_to_ref:.2e}, HF {ev.hf_to_ref:.2e}).", None


def evidence_for(dtype: str, run_id: str | None, diagnostics: Any) -> Evidence:
    """The diagnostics' evidence about one dtype's run (nothing when they were built on another run)."""
    if diagnostics is None:
        return Evidence()
    out = diagnostics.dtypes.get(dtype)
    if out is None or (run_id is not None and out.run_id != run_id):
        return Evidence()
    ref = out.reference or {}
    knob, share = best_knob(dtype, diagnostics.ablation)
    return Evidence(
        noise_ratio=out.ratio_to_hf_noise,
        hf_noise=(out.floor or {}).get("hf"),
        floor_words=(out.floor or {}).get("noise_words"),
        vllm_to_ref=(ref.get("vllm_vs_ref") or {}).get("mean"),
        hf_to_ref=(ref.get("hf_vs_ref") or {}).get("mean"),
        knob=knob,
        knob_share=share,
    )


def best_knob(dtype: str, ablation: Any) -> tuple[str | None, float | None]:
    """The setting whose change alone cuts this dtype's mean gap most, and the share it removes."""
    rows = [r for r in ablation or () if r.get("dtype") == dtype]
    base = next((r["mean_abs_delta"] for r in rows if r["knob"] == "baseline"), None)
    cuts = [r for r in rows if r["knob"] != "baseline" and r.get("change") is not None and r["change"] < 0]
    if not base or not cuts:
        return None, None
    best = min(cuts, key=lambda r: r["change"])
    return best["knob"], -best["change"] / base


def hf_noise_of(runs: list[Any], diagnostics: Any = None) -> dict[str, dict[str, Any]]:
    """Per dtype, HF's own noise and the gap's ratio to it, with where they come from: the stored
    diagnostics built on the run when any (they measure more), else the comparison's own floor;
    dtypes with neither are left out. The token view's meaning scale and the verdict use the same."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        ev = evidence_for(r.dtype, r.run_id, diagnostics)
        if ev.hf_noise is not None:
            texts = (diagnostics.dtypes[r.dtype].floor or {}).get("texts")
            out[r.dtype] = {
                "floor": ev.hf_noise,
                "ratio": ev.noise_ratio,
                "words": ev.floor_words,
                "source": f"HF against itself on {'every text' if texts is None else _texts(texts)}: stored diagnostics",
            }
        elif r.summary.get("hf_noise_mean") is not None:
            n = r.summary.get("noise_texts")
            out[r.dtype] = {
                "floor": r.summary["hf_noise_mean"],
                "ratio": r.summary.get("noise_ratio"),
                "words": r.summary.get("noise_words"),
                "source": f"HF against itself on {_texts(n) if n else 'a sample of the texts'}, measured with this comparison",
            }
    return out


def _texts(n: int) -> str:
    return "the text" if n == 1 else f"{n} texts"


def run_verdicts(runs: list[Any], diagnostics: Any = None) -> list[Verdict]:
    """The verdict of each run, with the evidence of the stored diagnostics built on it when any, and
    otherwise the noise floor the comparison measured itself (logprob_parity.analysis.floors). The one place
    the CLI, the Compare page, the Diagnostics page and the HTML report get verdicts."""
    return [verdict(r.summary, r.dtype, _run_evidence(r, diagnostics)) for r in runs]


def _run_evidence(run: Any, diagnostics: Any) -> Evidence:
    ev = evidence_for(run.dtype, run.run_id, diagnostics)
    if ev.noise_ratio is None and ev.hf_noise is None:
        s = run.summary
        ev = replace(ev, noise_ratio=s.get("noise_ratio"), hf_noise=s.get("hf_noise_mean"), floor_words=s.get("noise_words"))
    return ev


def prompt_verdicts(runs: list[Any], seq: int, diagnostics: Any = None) -> list[Verdict]:
    """The verdict of one prompt of each run: its own gap (the sequence's stored summary), judged
    against the same noise floor as the whole set, since HF's noise is measured once a comparison. What a
    diagnosis found for the set (a setting that removes the gap, the side closer to float64) is left out:
    it was measured on the set, not on this prompt."""
    out = []
    for r in runs:
        summary = r.meta.sequences[seq].summary
        ev = _run_evidence(r, diagnostics)
        mean = summary.get("mean_abs_delta")
        ratio = mean / ev.hf_noise if ev.hf_noise and mean is not None else None
        out.append(verdict(summary, r.dtype, Evidence(noise_ratio=ratio, hf_noise=ev.hf_noise, floor_words=ev.floor_words)))
    return out


def diagnosis_verdicts(diagnostics: Any) -> dict[str, Verdict]:
    """The verdict of each dtype of a diagnosis, from its own evidence (stored wording is not reused,
    so diagnostics stored by older versions read the same as new ones)."""
    return {d: verdict(_summary_of(out), d, evidence_for(d, None, diagnostics)) for d, out in diagnostics.dtypes.items()}


def _summary_of(out: Any) -> dict[str, Any]:
    """The comparison summary a diagnosis carries (its gap), with the argmax agreement when stored."""
    return {
        "max_abs_delta": out.gap.get("max"),
        "mean_abs_delta": out.gap.get("mean"),
        "argmax_agreement": out.gap.get("argmax_agreement"),
    }


def rollout_verdict(meta: Any) -> Verdict:
    """The verdict of a rollout, in the same words as a comparison's: the gap RL sees (vLLM decode vs
    HF) judged against the same tolerances and against HF's own measured noise, then what is
    particular to a rollout: the importance ratios, decode against vLLM's own prefill, decoding
    alone against in a batch, and the bias top-k/top-p add."""
    from logprob_parity.results.rollout import hf_floor, hf_floor_words

    s = meta.summary.get("decode_vs_hf") or {}
    floor = hf_floor(meta)
    mean = s.get("mean_abs_delta")
    ratio = mean / floor if (mean is not None and floor) else None
    base = verdict(s, meta.dtype, Evidence(noise_ratio=ratio, hf_noise=floor, floor_words=hf_floor_words(meta)))
    if s.get("n_tokens", 0) == 0:
        return base
    reasons = list(base.reasons)
    reasons.append(
        f"Importance ratio (trainer probability / rollout probability) per token: from {s['rollout_is_min']:.4g} to "
        f"{s['rollout_is_max']:.4g}; {s['frac_ratio_outside_0.8_1.25']:.1%} of tokens fall outside 0.8-1.25 and "
        f"{s['tis_clip_fraction']:.1%} would be clipped at the TIS cap of {s['tis_cap']:g}. Effective sample size "
        f"{s['rollout_is_eff_sample_size']:.2%} of the tokens."
    )
    dp = meta.summary.get("decode_vs_prefill") or {}
    if dp.get("mean_abs_delta") is not None:
        share = dp["mean_abs_delta"] / mean if mean else 0.0
        own = "a source of its own" if share >= 0.1 else "not where the gap comes from"
        reasons.append(
            f"vLLM's decode path against its own prefill on the same tokens: mean gap {dp['mean_abs_delta']:.2g} "
            f"(largest {dp['max_abs_delta']:.2g}), {share:.0%} of the decode-HF gap: decoding is {own}."
        )
    batch = (meta.floors or {}).get("decode_batch") or {}
    if batch.get("of"):
        moved = f"moved their logprobs by up to {batch['max']:.2g}" if batch.get("max") is not None else "could not be compared"
        reasons.append(
            f"Decoding {batch['of']} sample(s) alone instead of in the batch gave the same tokens for "
            f"{batch['same_tokens']} of them and {moved}."
        )
    kept = meta.sampling
    if kept.get("top_p", 1) < 1 or kept.get("top_k", -1) > 0:
        pv = meta.summary.get("processed_vs_trainer") or {}
        if pv.get("mean_delta") is not None:
            reasons.append(
                f"Top-k/top-p renormalise the rollout's probabilities over the tokens they keep: its processed "
                f"logprobs sit {pv['mean_delta']:.3g} above the trainer's on average, the log of the kept mass. "
                "A trainer that rescores without the cut sees this as mismatch."
            )
    reasons += routing_reasons(getattr(meta, "routing", None))
    return Verdict(base.level, "Rollout " + base.headline, tuple(reasons))


def routing_reasons(r: dict[str, Any] | None) -> list[str]:
    """An MoE rollout's routing in sentences: how many routers of vLLM's decode picked other experts
    than HF teacher-forced, and what routing replay leaves of the gap. [] for a dense model (and for
    a rollout stored before routing was measured); one sentence saying why when it was not measured."""
    from logprob_parity.engines.routing import NOT_MOE

    if not r or r.get("why") == NOT_MOE:
        return []
    if not r.get("measured"):
        return [f"MoE routing was not compared: {r.get('why')}"]
    lines = [
        f"MoE routing, vLLM's decode against HF (the trainer) on the same ids: {r['routing_flip_frac']:.2%} of "
        f"(token, layer) routers picked other experts; {r['routing_tokens_flipped']:.2%} of the {r['tokens']:,} "
        f"completion tokens were routed differently in at least one of {r['layers']} MoE layers (top-{r['top_k']})."
    ]
    rp = r.get("replay") or {}
    if rp.get("share_removed") is not None:
        lines.append(
            f"Routing replay (HF rescored with the decode's experts forced, R3's rule): mean |Δ logp| "
            f"{rp['mean_abs_delta_before']:.3g} → {rp['mean_abs_delta_after']:.3g}, so replaying vLLM's routing "
            f"removes {rp['share_removed']:.0%} of the gap (largest {rp['max_abs_delta_before']:.3g} → {rp['max_abs_delta_after']:.3g})."
        )
    return lines
