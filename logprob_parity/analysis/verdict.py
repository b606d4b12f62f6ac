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

import numpy as np

from logprob_parity.results.bands import (  # noqa: F401 - LEVELS and LEVEL_WORDS: read from here too
    LEVEL_WORDS,
    LEVELS,
    MATERIAL_P,
    VLLM_TEST_TOL,
    more_than_noise,
    share_beyond,
)

# RL trainers (verl, TRL) flag a trainer/rollout mismatch when mean |Δ logp| exceeds 0.1.
RL_MEAN_ABS = 0.1
# Importance-ratio bands: a token whose probability differs by more than 2x (5x) between engines.
RATIO_BANDS = (2.0, 5.0)
# A mean gap this many times HF's own mean noise is systematic: not explained by batching, padding or kernels.
SYSTEMATIC_NOISE_RATIO = 10.0
# One engine is "closer to the reference" when the other is this many times farther from it.
REFERENCE_SIDE_RATIO = 2.0
# A knob "removes the gap" when changing it alone cuts the mean gap by at least this share.
KNOB_SHARE = 0.5
# The share of pure noise that lies beyond the noise's tail (its 99.5th percentile: logprob_parity.analysis.floors)
NOISE_BEYOND_SHARE = 0.005

# The reason that opens with these words names tokens beyond the noise and the tolerance; a page adds where they are.
BEYOND_WORDS = "Some tokens differ by more than HF's own noise and vLLM's own tests allow"

THRESHOLDS = (
    "a token is beyond HF's noise past the 99.5th percentile of how far HF moves a token against itself",
    f"vLLM's test tolerance: |Δ logp| <= {VLLM_TEST_TOL[0]:g} (tight) / {VLLM_TEST_TOL[1]:g} (loose)",
    f"more tokens beyond both than the {NOISE_BEYOND_SHARE:.1%} noise leaves there (99% confidence): close",
    f"changes results: more argmax flips than HF's own, or such tokens moving a probability by {MATERIAL_P:g} or more",
    f"systematic: the mean gap is more than {SYSTEMATIC_NOISE_RATIO:g}x HF's own mean noise",
    f"RL trainers: mean |Δ logp| <= {RL_MEAN_ABS:g}",
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
    noise_tail: float | None = None  # HF's per-token noise tail (hf_noise_tail): where a token leaves the noise
    tail_words: str | None = None  # that tail in words ("HF moved 99.5% of 480 tokens by at most 0.11 against itself")
    noise_flip_frac: float | None = None  # HF's own argmax flips under the same variations (share of positions)
    noise_flip_n: int | None = None  # on how many positions
    noise_tail_n: int | None = None  # positions the tail was estimated on
    noise_tail_beyond: int | None = None  # of those, how many lie beyond it (about 1%)


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


def _share(k: int, n: int) -> str:
    if n:
        return f"{k:,} of {n:,} tokens ({k / n:.1%})"
    return "at least one token" if k == 1 else f"{k:,} tokens"


def _counts(summary: dict[str, Any], limit: float) -> dict[str, int]:
    """The band counts (logprob_parity.results.bands) of a summary; a summary stored without them (older
    runs, a diagnosis's gap) gives what its largest gap alone shows: at least that one token, of an
    unknown number (n = 0: no share is judged)."""
    n = int(summary.get("n_tokens") or 0)
    if summary.get("tokens_beyond") is not None:
        return {
            "n": n,
            "beyond": int(summary["tokens_beyond"]),
            "above": int(summary.get("tokens_above_noise") or 0),
            "material": int(summary.get("material_beyond") or 0),
            "flips": int(summary.get("argmax_flips") or 0),
        }
    mx = summary.get("max_abs_delta") or 0.0
    beyond = int(mx > max(limit, VLLM_TEST_TOL[1]))
    agree = summary.get("argmax_agreement")
    return {
        "n": 0,
        "beyond": beyond,
        "above": int(mx > limit),
        "material": int(beyond and (summary.get("max_prob_delta") or 0.0) >= MATERIAL_P),
        "flips": 0 if agree is None or agree == 1 else max(1, round((1 - agree) * n)),
    }


def verdict(summary: dict[str, Any], dtype: str, evidence: Evidence | float | None = None) -> Verdict:
    """The verdict of one dtype. `evidence` may be a bare noise ratio (older callers) or an Evidence.

    Like is compared with like: each token with the noise's tail, the mean with the noise's mean, argmax
    flips with HF's own flips. A token alone sets the level only when it is beyond the noise and material."""
    ev = Evidence(noise_ratio=evidence) if isinstance(evidence, (int, float)) else (evidence or Evidence())
    mx, mean = summary.get("max_abs_delta"), summary.get("mean_abs_delta")
    if mx is None or mean is None:
        return Verdict("differs", f"{dtype}: nothing was scored, so nothing can be said.", ())
    if ev.hf_noise is None and ev.noise_ratio:  # a bare ratio (older callers): the floor it implies
        ev = replace(ev, hf_noise=mean / ev.noise_ratio)
    measured = ev.noise_tail is not None or ev.hf_noise is not None
    limit = ev.noise_tail if ev.noise_tail is not None else (ev.hf_noise if ev.hf_noise is not None else 0.0)
    c = _counts(summary, limit if measured else 0.0)
    n = c["n"]
    tol = VLLM_TEST_TOL[1]
    reasons: list[str] = []
    tail_txt = ev.tail_words or (f"HF's own noise, {limit:.2g}" if measured else "")

    # 1. tokens against the noise's tail and the tolerance (the token view's bands)
    if not measured:
        if mx <= tol:
            reasons.append(
                f"Every token is within vLLM's own test tolerance: the largest gap is {mx:.2g} (a change of "
                f"{percent_change(mx)} in one token's probability), at most {tol:g} allowed."
            )
        else:
            reasons.append(
                f"{BEYOND_WORDS}: the largest gap is {mx:.2g} ({percent_change(mx)} in probability), above {tol:g}; "
                "HF's own noise is not measured, so whether that is noise is not known."
            )
    elif c["beyond"]:
        reasons.append(
            f"{BEYOND_WORDS}: {_share(c['beyond'], n)} beyond HF's own noise ({tail_txt}) and beyond "
            f"vLLM's test tolerance of {tol:g}; noise alone leaves about {NOISE_BEYOND_SHARE:.1%} of tokens beyond its "
            "99.5th percentile"
            + (
                ", so this is more than noise."
                if share_beyond(c["beyond"], n, NOISE_BEYOND_SHARE)
                else ", so this is what noise gives."
            )
        )
    else:
        reasons.append(
            f"No token is beyond both HF's own noise ({tail_txt}) and vLLM's test tolerance of {tol:g}"
            + (f"; beyond the noise but within the tolerance: {_share(c['above'], n)}." if c["above"] else ".")
        )
    # 2. the worst token: named, never the level on its own
    dp = summary.get("max_prob_delta")
    reasons.append(
        f"The largest gap is {mx:.2g} (a change of {percent_change(mx)} in one token's probability"
        + (f"; the largest change of any probability is {dp:.2g}" if dp is not None else "")
        + (")." if dp is None or dp >= MATERIAL_P else f", under the {MATERIAL_P:g} that would matter).")
    )
    ok_rl = mean <= RL_MEAN_ABS
    reasons.append(
        f"On average a token's probability differs by {percent_change(mean)} (mean |Δ logp| {mean:.2g}): "
        + ("within" if ok_rl else "above")
        + f" the {RL_MEAN_ABS:g} RL trainers accept between trainer and rollout."
    )
    # 3. argmax flips against HF's own
    flips_out = False
    if n and c["flips"]:
        if ev.noise_flip_frac is not None and ev.noise_flip_n:
            k0 = round(ev.noise_flip_frac * ev.noise_flip_n)
            flips_out = more_than_noise(c["flips"], n, k0, ev.noise_flip_n)
            reasons.append(
                f"The engines' most likely next token differs at {_share(c['flips'], n)}; HF changes its own at "
                f"{ev.noise_flip_frac:.1%} of {ev.noise_flip_n:,} positions under the same variations: "
                + ("more than HF's own, so generated text can diverge." if flips_out else "no more than HF's own.")
            )
        else:
            reasons.append(f"The engines' most likely next token differs at {_share(c['flips'], n)}: generated text can diverge.")

    silent = ev.noise_ratio is None and ev.hf_noise == 0  # HF gave bit-identical values against itself
    mean_out = (ev.noise_ratio is not None and ev.noise_ratio > SYSTEMATIC_NOISE_RATIO) or (silent and mean > 0)
    how = f" ({ev.floor_words})" if ev.floor_words else ""
    if silent:
        reasons.append(
            "HF gave identical values against itself under every variation measured"
            + how
            + ": its own noise measured 0, so "
            + ("any gap is above it: systematic." if mean > 0 else "and so is the gap.")
        )
    elif ev.noise_ratio is not None:
        if mean_out:
            reasons.append(
                f"The mean gap is {ev.noise_ratio:.3g}x HF's own mean noise{how}: it is systematic, not what a trainer's "
                "own batching, padding or chunking does to it."
            )
        else:
            reasons.append(f"The mean gap is {ev.noise_ratio:.2g}x HF's own mean noise{how}: about what HF does to itself.")
    side, side_clause = _reference_words(ev)
    if side:
        reasons.append(side)
    fix = None
    if ev.knob and ev.knob_share is not None and ev.knob_share >= KNOB_SHARE:
        fix = f"{ev.knob} removes {ev.knob_share:.1%} of the gap"
        reasons.append(f"Changing one setting, {ev.knob}, removes {ev.knob_share:.1%} of the mean gap.")

    level, head = _level(dtype, summary, ev, c, measured, mean_out, flips_out, silent)
    extra = [s for s in (side_clause, fix) if s]
    if extra and level != "match":
        head += " " + "; ".join(extra) + "."
    return Verdict(level, head, tuple(reasons))


def beyond_noise_share(k: int, n: int, ev: Evidence) -> bool:
    """k of n tokens beyond the noise's tail is more than noise puts there (99% confidence): against the
    noise's own positions beyond its tail where known (results.bands.more_than_noise), else against
    NOISE_BEYOND_SHARE."""
    if ev.noise_tail_n and ev.noise_tail_beyond is not None:
        return more_than_noise(k, n, ev.noise_tail_beyond, ev.noise_tail_n)
    return share_beyond(k, n, NOISE_BEYOND_SHARE)


def noise_share_words(ev: Evidence) -> str:
    """' (HF's own: 2 of 200)' where the noise's own count beyond its tail is known."""
    if ev.noise_tail_n and ev.noise_tail_beyond is not None:
        return f" (HF's own: {ev.noise_tail_beyond:,} of {ev.noise_tail_n:,})"
    return ""


def _level(
    dtype: str,
    summary: dict[str, Any],
    ev: Evidence,
    c: dict[str, int],
    measured: bool,
    mean_out: bool,
    flips_out: bool,
    silent: bool,
) -> tuple[str, str]:
    """The level and its headline, from the comparisons `verdict` made."""
    mx, mean, n = summary["max_abs_delta"], summary["mean_abs_delta"], c["n"]
    per = percent_change(mean)
    if not measured:
        material = mx > VLLM_TEST_TOL[1] and (summary.get("max_prob_delta") or 0.0) >= MATERIAL_P
        if mean > RL_MEAN_ABS or material:
            why = "on average" if mean > RL_MEAN_ABS else "a token's probability moves by a material amount"
            return "differs", f"{dtype}: the engines differ enough to change results ({why}: {per} per token)."
        if mx > VLLM_TEST_TOL[1]:
            return "close", f"{dtype}: close on average ({per} per token), but some tokens are beyond vLLM's test tolerance."
        return "unmeasured", (
            f"{dtype}: within vLLM's own test tolerance; HF's own noise is not yet measured, so whether the gap is "
            "more than noise is not known (Diagnostics measures it)."
        )
    tail_out = beyond_noise_share(c["beyond"], n, ev)
    above_out = beyond_noise_share(c["above"], n, ev)
    if flips_out or (tail_out and c["material"]) or (mean > RL_MEAN_ABS and mean_out):
        why = (
            "the most likely next token changes more often than HF changes its own"
            if flips_out
            else f"{c['material']:,} token(s) beyond HF's noise move a probability by {MATERIAL_P:g} or more"
            if tail_out and c["material"]
            else f"the mean gap, {mean:.2g}, is above the RL bound and {ev.noise_ratio:.3g}x HF's own mean noise"
            if ev.noise_ratio
            else f"the mean gap, {mean:.2g}, is above the RL bound and HF's own noise"
        )
        return "differs", f"{dtype}: the engines differ enough to change results: {why}."
    if tail_out:
        return "close", (
            f"{dtype}: close on average ({per} per token), but {c['beyond'] / n:.1%} of tokens are beyond both HF's "
            "own noise and vLLM's test tolerance, more than noise gives."
        )
    if mean_out or above_out:
        what = (
            "above HF's own noise of 0"
            if silent
            else f"{ev.noise_ratio:.3g}x HF's own mean noise"
            if mean_out
            else f"{c['above'] / n:.1%} of tokens lie beyond HF's own noise"
        )
        return "systematic", f"{dtype}: within vLLM's test tolerance, but systematic: {what}."
    ratio = f", {ev.noise_ratio:.2g}x HF's own mean noise" if ev.noise_ratio is not None else ""
    return "match", (
        f"{dtype}: vLLM is as far from HF as HF is from itself: the gap is within HF's own noise "
        f"(on average {per} per token{ratio})."
    )


def _ref_ratio(ev: Evidence) -> float | None:
    if ev.vllm_to_ref is None or ev.hf_to_ref is None:
        return None
    if ev.hf_to_ref == 0:
        return math.inf if ev.vllm_to_ref > 0 else 1.0
    return ev.vllm_to_ref / ev.hf_to_ref


def closer_to_reference(vllm_to_ref: float | None, hf_to_ref: float | None) -> str | None:
    """The one rule for "closer to float64", for the verdict and the Diagnostics table alike: 'vLLM' or
    'HF' when the other engine is at least REFERENCE_SIDE_RATIO times farther from the reference,
    'neither' when they are within that of each other, None when not measured."""
    r = _ref_ratio(Evidence(vllm_to_ref=vllm_to_ref, hf_to_ref=hf_to_ref))
    if r is None:
        return None
    if r >= REFERENCE_SIDE_RATIO:
        return "HF"
    if r == 0 or 1 / r >= REFERENCE_SIDE_RATIO:
        return "vLLM"
    return "neither"


def _reference_words(ev: Evidence) -> tuple[str | None, str | None]:
    """(reason, headline clause) about which engine is closer to the float64 reference (closer_to_reference);
    the clause only when one side is closer."""
    closer = closer_to_reference(ev.vllm_to_ref, ev.hf_to_ref)
    if closer is None:
        return None, None
    if closer == "neither":
        return (
            f"Both engines are about as far from a float64 reference (vLLM {ev.vllm_to_ref:.2e}, HF {ev.hf_to_ref:.2e}: "
            f"within {REFERENCE_SIDE_RATIO:g}x of each other), so neither is closer.",
            None,
        )
    r = _ref_ratio(ev)
    far, near = ("vLLM", "HF") if closer == "HF" else ("HF", "vLLM")
    x = r if closer == "HF" else (1 / r if r else math.inf)
    far_d, near_d = (ev.vllm_to_ref, ev.hf_to_ref) if far == "vLLM" else (ev.hf_to_ref, ev.vllm_to_ref)
    return (
        f"Against a float64 reference, {far} is {x:.3g}x farther from it than {near} "
        f"({far_d:.2e} against {near_d:.2e}): the gap comes from {far}'s side.",
        f"{far} is {x:.3g}x farther from the float64 reference than {near}",
    )


def evidence_for(dtype: str, run_id: str | None, diagnostics: Any) -> Evidence:
    """The diagnostics' evidence about one dtype's run (nothing when they were built on another run)."""
    if diagnostics is None:
        return Evidence()
    out = diagnostics.dtypes.get(dtype)
    if out is None or (run_id is not None and out.run_id != run_id):
        return Evidence()
    ref = out.reference or {}
    knob, share = best_knob(dtype, diagnostics.ablation)
    fl = out.floor or {}
    return Evidence(
        noise_ratio=out.ratio_to_hf_noise,
        hf_noise=fl.get("hf"),
        floor_words=fl.get("noise_words"),
        vllm_to_ref=(ref.get("vllm_vs_ref") or {}).get("mean"),
        hf_to_ref=(ref.get("hf_vs_ref") or {}).get("mean"),
        knob=knob,
        knob_share=share,
        **_tail_evidence(fl),
    )


def _tail_evidence(floor: dict[str, Any]) -> dict[str, Any]:
    """The tail and flip fields of an Evidence from a floor's keys (logprob_parity.analysis.floors.tail_of);
    a floor stored before the tail gives its largest value as the tail."""
    from logprob_parity.results.bands import tail_words

    tail = floor.get("hf_noise_tail")
    if tail is None and floor.get("hf_noise_max") is not None:
        tail = floor["hf_noise_max"]
        words = f"HF moved a token by at most {tail:.2g} against itself"
    else:
        words = tail_words(floor)
    return {
        "noise_tail": tail,
        "tail_words": words,
        "noise_flip_frac": floor.get("hf_noise_flip_frac"),
        "noise_flip_n": floor.get("noise_flip_positions"),
        "noise_tail_n": floor.get("noise_tail_positions"),
        "noise_tail_beyond": floor.get("noise_tail_beyond"),
    }


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
                "tail": ev.noise_tail,
                "tail_words": ev.tail_words,
                "ratio": ev.noise_ratio,
                "words": ev.floor_words,
                "source": f"HF against itself on {'every text' if texts is None else _texts(texts)}: stored diagnostics",
            }
        elif r.summary.get("hf_noise_mean") is not None:
            n = r.summary.get("noise_texts")
            te = _tail_evidence(r.summary)
            out[r.dtype] = {
                "floor": r.summary["hf_noise_mean"],
                "tail": te["noise_tail"],
                "tail_words": te["tail_words"],
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
    out = []
    for r in runs:
        ev = _run_evidence(r, diagnostics)
        v = verdict(with_counts(r.summary, ev, lambda r=r: r.column_frame(list(COUNT_COLUMNS))), r.dtype, ev)
        if "hf_null" in tuple(getattr(r.meta, "backends", ()) if hasattr(r, "meta") else ()):
            head = v.headline.replace("vLLM is as far from HF as HF is from itself", "HF's own noise reads as noise")
            v = replace(v, headline=f"{NULL_WORDS}: {head}")
        out.append(v)
    return out


def with_verdict(run: Any) -> Any:
    """The run with its verdict in its meta (what its --json carries): as made, or made now for a run
    stored before verdicts were stored; anything but a comparison run is returned as it is."""
    meta = getattr(run, "meta", None)
    if meta is None or not hasattr(meta, "verdict") or not hasattr(run, "sequences") or meta.verdict:
        return run
    return replace(run, meta=replace(meta, verdict=run_verdicts([run])[0].to_dict()))


# A null comparison's verdict opens with these words: its "vLLM" side is HF itself (compare --null).
NULL_WORDS = "What noise looks like (HF against itself, no vLLM)"


COUNT_COLUMNS = ("abs_delta", "prob_delta", "argmax_agree", "scored")


def with_counts(summary: dict[str, Any], ev: Evidence, columns: Any) -> dict[str, Any]:
    """The summary with its band counts (logprob_parity.results.bands) against the evidence's noise tail:
    as stored when they were counted against that tail, else counted again from `columns()` (a frame
    of COUNT_COLUMNS), so a diagnosis that measured another tail colours and judges by its own."""
    from logprob_parity.results.bands import band_stats

    if ev.noise_tail is None or summary.get("noise_limit") == ev.noise_tail:
        return summary
    f = columns()
    if f is None or len(f) == 0:
        return summary
    return {**summary, **band_stats(f["abs_delta"], f["prob_delta"], f["argmax_agree"], f["scored"], ev.noise_tail, "tail")}


def _run_evidence(run: Any, diagnostics: Any) -> Evidence:
    ev = evidence_for(run.dtype, run.run_id, diagnostics)
    if ev.noise_ratio is None and ev.hf_noise is None:
        s = run.summary
        ev = replace(
            ev,
            noise_ratio=s.get("noise_ratio"),
            hf_noise=s.get("hf_noise_mean"),
            floor_words=s.get("noise_words"),
            **_tail_evidence(s),
        )
    return ev


def prompt_verdicts(runs: list[Any], seq: int, diagnostics: Any = None, columns: Any = None) -> list[Verdict]:
    """The verdict of one prompt of each run: its own gap (the sequence's stored summary), judged
    against the same noise floor as the whole set, since HF's noise is measured once a comparison. What a
    diagnosis found for the set (a setting that removes the gap, the side closer to float64) is left out:
    it was measured on the set, not on this prompt. `columns`: {run_id: {seq: COUNT_COLUMNS}} read once
    for every prompt (every_prompt_verdict); else this prompt's positions are read."""
    out = []
    for r in runs:
        summary = r.meta.sequences[seq].summary
        ev = _run_evidence(r, diagnostics)
        mean = summary.get("mean_abs_delta")
        ratio = mean / ev.hf_noise if ev.hf_noise and mean is not None else None
        own = replace(ev, noise_ratio=ratio, vllm_to_ref=None, hf_to_ref=None, knob=None, knob_share=None)

        def read(r: Any = r) -> dict[str, Any]:
            if columns is not None:
                return columns[r.run_id].get(seq, {})
            m = r.sequences[seq].metrics
            return {"abs_delta": m.abs_delta, "prob_delta": m.prob_delta, "argmax_agree": m.argmax_agree, "scored": m.scored}

        counted = with_counts({**summary, "noise_limit": None}, own, read)
        out.append(verdict(counted, r.dtype, own))
    return out


def every_prompt_verdict(runs: list[Any], diagnostics: Any = None) -> list[list[Verdict]]:
    """prompt_verdicts of every prompt (one list of each run's verdicts a prompt), each run's counted
    columns read once for the whole set: the Prompt set table's verdict column."""
    n = min(len(r.meta.sequences) for r in runs)
    columns: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        f = r.column_frame(list(COUNT_COLUMNS))
        order = np.argsort(f["seq"].to_numpy(), kind="stable")  # a prompt's positions, together and in order
        seqs = f["seq"].to_numpy()[order]
        cuts = np.flatnonzero(np.diff(seqs)) + 1 if len(seqs) else np.zeros(0, int)
        starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(seqs)]])
        arrays = {k: f[k].to_numpy()[order] for k in COUNT_COLUMNS}
        columns[r.run_id] = {int(seqs[a]): {k: v[a:b] for k, v in arrays.items()} for a, b in zip(starts, ends) if b > a}
    return [prompt_verdicts(runs, i, diagnostics, columns) for i in range(n)]


def diagnosis_verdicts(diagnostics: Any) -> dict[str, Verdict]:
    """The verdict of each dtype of a diagnosis, from its own evidence (stored wording is not reused,
    so diagnostics stored by older versions read the same as new ones)."""
    return {d: verdict(_summary_of(out), d, evidence_for(d, None, diagnostics)) for d, out in diagnostics.dtypes.items()}


def _summary_of(out: Any) -> dict[str, Any]:
    """The comparison summary a diagnosis carries (its gap), with the argmax agreement when stored."""
    return {
        **{k: v for k, v in out.gap.items() if k not in ("max", "mean")},
        "max_abs_delta": out.gap.get("max"),
        "mean_abs_delta": out.gap.get("mean"),
        "argmax_agreement": out.gap.get("argmax_agreement"),
    }


def rollout_verdict(meta: Any) -> Verdict:
    """The verdict of a rollout, in the same words as a comparison's: the gap RL sees (vLLM decode vs
    HF) judged against the same tolerances and against HF's own measured noise, then what is
    particular to a rollout: the importance ratios, decode against vLLM's own prefill, decoding
    alone against in a batch, and the bias top-k/top-p add."""
    from logprob_parity.results.rollout import hf_floor, hf_floor_words, hf_tail

    s = meta.summary.get("decode_vs_hf") or {}
    floor = hf_floor(meta)
    mean = s.get("mean_abs_delta")
    ratio = mean / floor if (mean is not None and floor) else None
    ev = Evidence(noise_ratio=ratio, hf_noise=floor, floor_words=hf_floor_words(meta), **_tail_evidence(hf_tail(meta)))
    base = verdict(s, meta.dtype, ev)
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
