"""The noise floor every comparison measures beside its gap, on the same ids, cheaply.

Why: a gap means something only against what each engine does to itself. Diagnostics measure that
at length; most people stop at the Compare page, so every comparison measures the cheap part too,
on a sample of its own texts (the first ones, up to NOISE_TOKENS positions), and the verdict judges
the gap against it:
- HF against itself: the sample scored in one right-padded batch with a few other prompts (or one
  sequence a pass, when the comparison already batches HF), against the comparison's own HF values;
- vLLM against itself: the sample scored each alone, and batched with the same other prompts,
  against the comparison's own vLLM values.
`noise_ratio` is the comparison's mean gap over HF's own mean noise: above 10 the gap is systematic
(logprob_parity.analysis.verdict).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.inputs.tokens import encode_texts

NOISE_TOKENS = 2048  # positions of the comparison's own texts the floor is measured on, at most
OTHER_PROMPTS = 6  # other prompts batched beside the sample (the diagnostics' filler)
FLOOR_KEYS = ("hf_noise_mean", "hf_noise_max", "vllm_noise_mean", "vllm_noise_max", "noise_ratio", "noise_tokens")


def other_prompts(tokenizer: Any, bos: str, max_len: int) -> list[list[int]]:
    """The bundled sentences as token ids, those that fit the engines' context."""
    lines = (Path(__file__).resolve().parent.parent / "data" / "sentences.txt").read_text().splitlines()[:OTHER_PROMPTS]
    ids, _ = encode_texts(tokenizer, lines, bos)
    return [x for x in ids if len(x) < max_len]


def sample_of(seqs: list[list[int]]) -> int:
    """How many of the first sequences the floor is measured on: up to NOISE_TOKENS positions, at least one."""
    n, used = 0, 0
    for s in seqs:
        if n and used + len(s) - 1 > NOISE_TOKENS:
            break
        n += 1
        used += len(s) - 1
    return n


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
    """|a - b| over positions both sides scored: mean, max, and how many."""
    d = np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) for x, y in zip(a, b)])
    d = d[np.isfinite(d)]
    if d.size == 0:
        return {"mean": None, "max": None, "n": 0}
    return {"mean": float(d.mean()), "max": float(d.max()), "n": int(d.size)}


def measure(
    vllm: Any, hf: Any, seqs: list[list[int]], scores: dict[str, list[Any]], others: list[list[int]], hf_batch_size: int
) -> dict[str, Any]:
    """The floor on the first sequences of a scored batch (`scores`: each side's values of `seqs`).
    vllm, hf: the engines' hosts (the same engines the comparison used)."""
    n = sample_of(seqs)
    sample = [list(s) for s in seqs[:n]]
    main_v = [s.logprob for s in scores["vllm"][:n]]
    main_h = [s.logprob for s in scores["hf"][:n]]
    # one text alone was already scored alone: the batched-with-others call is its floor then
    v_alone = [s.logprob for s in vllm.score(sample, 1, None, 1)] if len(seqs) > 1 else main_v
    v_batched = [s.logprob for s in vllm.score(sample + others, 1)[:n]]
    if hf_batch_size > 1:  # the comparison batched HF: its floor is one sequence a pass
        h_other, how = [s.logprob for s in hf.score(sample, 1, None, 1)], "one sequence a pass"
    else:
        together = sample + others
        h_other = [s.logprob for s in hf.score(together, 1, None, len(together), "right")[:n]]
        how = f"in one right-padded batch with {len(others)} other prompts"
    v1, v2, h = gap(main_v, v_alone), gap(main_v, v_batched), gap(main_h, h_other)
    means = [g["mean"] for g in (v1, v2) if g["mean"] is not None]
    maxes = [g["max"] for g in (v1, v2) if g["max"] is not None]
    return {
        "hf_noise_mean": h["mean"],
        "hf_noise_max": h["max"],
        "vllm_noise_mean": max(means) if means else None,
        "vllm_noise_max": max(maxes) if maxes else None,
        "noise_tokens": h["n"],
        "noise_what": (
            f"HF against itself: {n} of the texts ({h['n']} tokens) scored {how}; vLLM against itself: the same "
            f"texts each alone, and batched with {len(others)} other prompts"
        ),
    }


def with_ratio(floor: dict[str, Any] | None, mean_abs_delta: float | None) -> dict[str, Any]:
    """The floor's summary keys (FLOOR_KEYS), with noise_ratio = the mean gap over HF's own mean noise
    (None when HF's noise measured 0: nothing to divide by); every key None when not measured."""
    if not floor:
        return dict.fromkeys(FLOOR_KEYS)
    out = {k: floor.get(k) for k in FLOOR_KEYS}
    hn = floor.get("hf_noise_mean")
    out["noise_ratio"] = mean_abs_delta / hn if (mean_abs_delta is not None and hn) else None
    return out
