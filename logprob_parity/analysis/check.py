"""A parity gate for CI: does a stored run stay within bounds, or not much worse than a baseline?

`check(runs, bounds, baseline=None)` judges each run's summary against fixed bounds (the largest and
mean |Δ logp|, the mean exact KL, the share of positions whose most likely token agrees) and, with a
baseline run of the same model and token ids, against that run's own values times `max_worsening`.
Every bound is one `Outcome` with its words; the CLI prints one line each and exits 0 when all hold,
1 when one fails. A bound whose value was not measured (a run without the exact KL) fails, and says
why: a gate that cannot see must not pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from logprob_parity.errors import UserError

# summary key -> (words, which way is better): "max" keys must stay at or below a bound, "min" at or above
KEYS = {
    "mean_abs_delta": ("mean |Δ logp|", "max"),
    "max_abs_delta": ("largest |Δ logp|", "max"),
    "kl_full_mean": ("mean exact KL", "max"),
    "argmax_agreement": ("same top token (share of positions)", "min"),
    "routing_flip_frac": ("MoE routers whose experts differ (share of token-layer pairs)", "max"),
}


@dataclass(frozen=True)
class Bounds:
    """Fixed bounds (None: not checked) and, for a baseline, the factor a gap may grow by."""

    max_mean_abs_delta: float | None = None
    max_abs_delta: float | None = None
    max_kl_mean: float | None = None
    min_argmax_agreement: float | None = None
    max_routing_flip_frac: float | None = None
    max_worsening: float = 1.5

    def fixed(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (
                ("mean_abs_delta", self.max_mean_abs_delta),
                ("max_abs_delta", self.max_abs_delta),
                ("kl_full_mean", self.max_kl_mean),
                ("argmax_agreement", self.min_argmax_agreement),
                ("routing_flip_frac", self.max_routing_flip_frac),
            )
            if v is not None
        }


@dataclass(frozen=True)
class Outcome:
    run_id: str
    dtype: str
    key: str
    value: float | None
    limit: float | None
    passed: bool
    words: str  # the line a CI log shows


@dataclass(frozen=True)
class CheckResult:
    outcomes: tuple[Outcome, ...]
    baseline: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def lines(self) -> list[str]:
        return [o.words for o in self.outcomes] + list(self.notes)

    def to_pandas(self) -> Any:
        """One row a bound: run, dtype, what, value, limit, passed."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "run_id": o.run_id,
                    "dtype": o.dtype,
                    "key": o.key,
                    "value": o.value,
                    "limit": o.limit,
                    "passed": o.passed,
                    "words": o.words,
                }
                for o in self.outcomes
            ]
        )


def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return "not measured"
    return f"{v:.2%}" if key in ("argmax_agreement", "routing_flip_frac") else f"{v:.3e}"


def _outcome(run: Any, key: str, limit: float | None, why: str) -> Outcome:
    words, way = KEYS[key]
    value = run.summary.get(key)
    if value is None or limit is None:
        ok = False
        why = (getattr(getattr(run, "meta", None), "routing", None) or {}).get("why") if key.startswith("routing") else None
        detail = (
            f"{words} is not measured in this run" + (f": {why}" if why else "")
            if value is None
            else f"the baseline has no {words}"
        )
    else:
        ok = value <= limit if way == "max" else value >= limit
        # a true statement either way: the relation that holds, then what it means for the bound
        if way == "max":
            relation = "<=" if ok else ">"
            meaning = "within the bound" if ok else "above the bound"
        else:
            relation = ">=" if ok else "<"
            meaning = "within the bound" if ok else "below the bound"
        detail = f"{words} {_fmt(key, value)} {relation} {_fmt(key, limit)}, {meaning}"
    tag = "PASS" if ok else "FAIL"
    return Outcome(run.run_id, run.dtype, key, value, limit, ok, f"{tag} {run.dtype} run {run.run_id[:12]}: {detail} ({why})")


def same_comparison(a: Any, b: Any) -> str | None:
    """None when runs a and b compared the same model on the same token ids, else why not."""
    ma, mb = a.meta, b.meta
    if ma.model_identity != mb.model_identity:
        return f"they are of different models ({ma.model} and {mb.model})"
    if [s.text for s in ma.sequences] != [s.text for s in mb.sequences]:
        return "they compared different texts"
    if [s.n_positions for s in ma.sequences] != [s.n_positions for s in mb.sequences]:
        return "their texts were tokenized differently"
    import numpy as np

    ia, ib = a.column_frame(["token_id"])["token_id"].to_numpy(), b.column_frame(["token_id"])["token_id"].to_numpy()
    if not np.array_equal(ia, ib):
        return "their token ids differ"
    return None


def check(runs: list[Any], bounds: Bounds, baseline: Any | None = None) -> CheckResult:
    """Each run against the fixed bounds and, with a baseline, against the baseline times
    max_worsening (for the agreement: the share of disagreeing positions times it). Raises
    UserError when nothing is to be checked or the baseline is not a run of the same comparison."""
    fixed = bounds.fixed()
    if not fixed and baseline is None:
        raise UserError(
            "no bound given: pass --max-mean-abs-delta, --max-abs-delta, --max-kl-mean, --min-argmax-agreement, "
            "--max-routing-flip-frac or --baseline RUN_ID"
        )
    if bounds.max_worsening < 1:
        raise UserError(f"--max-worsening must be at least 1 (got {bounds.max_worsening})")
    out: list[Outcome] = []
    for run in runs:
        for key, limit in fixed.items():
            out.append(_outcome(run, key, limit, "fixed bound"))
        if baseline is not None:
            why = same_comparison(run, baseline)
            if why:
                raise UserError(f"run {run.run_id} cannot be checked against baseline {baseline.run_id}: {why}")
            f = bounds.max_worsening
            for key in ("mean_abs_delta", "max_abs_delta", "kl_full_mean", "routing_flip_frac"):
                base = baseline.summary.get(key)
                if base is None and run.summary.get(key) is None:
                    continue  # measured in neither: nothing to compare
                out.append(
                    _outcome(
                        run, key, None if base is None else base * f, f"baseline {baseline.run_id[:12]} {_fmt(key, base)} x {f:g}"
                    )
                )
            agree = baseline.summary.get("argmax_agreement")
            if agree is not None:
                limit = 1 - (1 - agree) * f
                out.append(
                    _outcome(
                        run,
                        "argmax_agreement",
                        limit,
                        f"baseline {baseline.run_id[:12]} disagrees at {1 - agree:.2%} of positions; at most {f:g}x that",
                    )
                )
    return CheckResult(tuple(out), baseline.run_id if baseline is not None else None, _verdict_notes(runs))


def _verdict_notes(runs: list[Any]) -> tuple[str, ...]:
    """Each run's verdict and the noise floor it judges against: the same level the pages, the report
    and --json give (logprob_parity.analysis.verdict), beside the gate, not part of it."""
    from logprob_parity.analysis.verdict import run_verdicts

    out = []
    for run, v in zip(runs, run_verdicts(runs)):
        floor = run.summary.get("hf_noise_mean")
        words = run.summary.get("noise_words")
        where = (
            f"HF's own floor {floor:.2g}" + (f" ({words})" if words else "")
            if floor is not None
            else "HF's own floor not measured"
        )
        n, beyond = run.summary.get("n_tokens"), run.summary.get("tokens_beyond")
        bands = f"; {beyond:,} of {n:,} tokens beyond HF's noise and vLLM's tolerance" if beyond is not None and n else ""
        out.append(f"verdict {run.dtype} {run.run_id[:12]}: {v.title}; {where}{bands}")
    return tuple(out)
