"""The noise floor: how far HF moves from itself when only what a trainer changes step to step
changes. One definition, used by every view (Compare, Prompt set, Rollout, Diagnostics, the report,
`--json`, `check`).

Why one: Compare used to measure HF in one padded batch of 7 texts (on a CPU that reads exactly 0),
Diagnostics added chunked and token-by-token scoring (3e-6), the colour legend assumed a third floor
(one rounding step), and the three told a room three stories about the same numbers.

The definition, HF against itself on the same token ids (VARIATIONS, in the order measured):
- micro_batch: the texts in the comparison's own micro-batch (one a forward by default), against all
  of them in one large right-padded batch (other prompts added until it holds large_positions(device)
  positions, so the matrix products take another shape, as a trainer's micro-batch of thousands of
  tokens does);
- padding_side: that same batch padded on the left instead of the right;
- packed: the texts packed into rows with restarting position ids, as padding-free trainers (TRL,
  verl) feed them;
- chunked_kv: the texts fed CHUNK tokens a forward through the KV cache, as trainers that score in
  chunks do.

The floor of a dtype is the largest of their mean |Δ logp|; the verdict names the variation that set
it ("HF moves 3e-3 when its micro-batch changes from 1 to 32 sequences"). Compare measures it on a
sample of its texts (the first, up to noise_tokens(device) positions and a twentieth of its own): the
cheap part. Diagnostics
measures it on every text, and takes the comparison's own values when the sample already held every
text, so both pages judge against one number. vLLM's own noise (alone against batched) is measured
beside it and shown; the verdict judges against HF's, the trainer's side, whose values an RL loss
holds fixed. A floor that is not measured is said to be so; it is never taken as 0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.inputs.tokens import encode_texts

VARIATIONS = ("micro_batch", "padding_side", "packed", "chunked_kv")
DEFINITION = "hf:" + ",".join(VARIATIONS)  # in each run's identity: a run measured by another definition is another run
OTHER_PROMPTS = 6  # other prompts beside the sample: packed with it, and in its batch on a GPU
OTHER_PROMPTS_CPU = 1  # in its padded batch on a CPU, where each position costs milliseconds (padded to the longest text)
CHUNK = 64  # tokens a forward through HF's KV cache in chunked_kv (at least two chunks a text)
FLOOR_KEYS = (
    "hf_noise_mean",
    "hf_noise_max",
    "vllm_noise_mean",
    "vllm_noise_max",
    "noise_ratio",
    "noise_tokens",
    "noise_set_by",
    "noise_words",
    "noise_measured",
    "noise_texts",
)


def noise_tokens(device: str) -> int:
    """Positions of the comparison's own texts the floor is measured on, at most: the cheap part,
    a small share of a large comparison (a GPU's forward costs little; a CPU's is the comparison)."""
    return 2048 if str(device).startswith("cuda") else 512


def large_positions(device: str) -> int:
    """Positions in the large micro-batch, at least: thousands on a GPU, where the GEMMs change
    kernels with the batch's shape; on a CPU, where every position costs as much as the comparison's
    own, the sample and the other prompts once (its kernels did not move with the batch here)."""
    return 4096 if str(device).startswith("cuda") else 0


def other_prompts(tokenizer: Any, bos: str, max_len: int, device: str = "cuda") -> list[list[int]]:
    """The bundled sentences as token ids, those that fit the engines' context."""
    lines = (Path(__file__).resolve().parent.parent / "data" / "sentences.txt").read_text().splitlines()[:OTHER_PROMPTS]
    ids, _ = encode_texts(tokenizer, lines, bos)
    return [x for x in ids if len(x) < max_len]


SAMPLE_SHARE = 20  # the sample holds at most 1/20 of the comparison's positions (at least one text)


def sample_of(seqs: list[list[int]], device: str = "cuda") -> int:
    """How many of the first sequences the floor is measured on: up to noise_tokens(device)
    positions and 1/SAMPLE_SHARE of the comparison's, at least one text. Its four variations cost about
    four passes of HF over the sample, so the floor stays a small share of a large comparison."""
    total = sum(len(s) - 1 for s in seqs)
    n, used, cap = 0, 0, min(noise_tokens(device), total // SAMPLE_SHARE)
    for s in seqs:
        if n and used + len(s) - 1 > cap:
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


def filled(seqs: list[list[int]], others: list[list[int]], positions: int) -> list[list[int]]:
    """The large batch: the texts, then the other prompts (over again) until `positions` positions,
    with at least one other prompt, so it is a batch even for one long text."""
    out = [list(s) for s in seqs]
    pool = others or [list(s) for s in seqs]
    k = 0
    while k < len(pool) or sum(map(len, out)) < positions:
        out.append(list(pool[k % len(pool)]))
        k += 1
        if k > 100_000:  # pragma: no cover - prompts of length 0 cannot reach the target
            break
    return out


def variation_words(key: str, v: dict[str, Any]) -> str:
    """A variation in the words a verdict uses: 'HF moves 3e-03 when its micro-batch ...'."""
    moved = f"HF moves {v['mean']:.2g} on average (at most {v['max']:.2g})" if v.get("mean") is not None else "HF moves"
    return moved + " " + variation_when(key, v)


def variation_when(key: str, v: dict[str, Any]) -> str:
    """What changed in a variation, in words."""
    if key == "micro_batch":
        return (
            f"when its micro-batch changes from {v.get('from', 1)} to {v.get('to', '?')} sequences "
            f"({v.get('positions', '?'):,} positions)"
        )
    if key == "padding_side":
        return f"when that batch of {v.get('to', '?')} is padded on the left instead of the right"
    if key == "packed":
        return "when the texts are packed into one row with restarting position ids (padding-free training)"
    if key == "chunked_kv":
        return f"when it scores {v.get('chunk', CHUNK)} tokens a forward through its KV cache"
    return "when " + key.replace("_", " ")


def hf_variations(
    hf: Any,
    seqs: list[list[int]],
    base: list[np.ndarray],
    others: list[list[int]],
    device: str,
    starts: list[int] | None = None,
    hf_batch_size: int = 1,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each variation of the definition on `seqs` (hf: an HF engine host; base: the values the
    comparison's HF gave them in its micro-batch of hf_batch_size sequences, per position with NaN
    where unscored). Each variation is against base, padding_side against the same large batch padded
    on the right. Gaps count positions from `starts` on (a rollout's completion; 1 = every scored
    position). Returns (measured variations, skipped: key -> why)."""
    n = len(seqs)
    starts = list(starts) if starts is not None else [1] * n

    def cut(arrs: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(a, np.float64)[s:] for a, s in zip(arrs, starts)]

    # a padded batch costs its longest text a row: on a CPU, one other prompt in it (packing wastes nothing)
    in_batch = others if str(device).startswith("cuda") else others[:OTHER_PROMPTS_CPU]
    big = filled(seqs, in_batch, large_positions(device))
    size = {"to": len(big), "positions": sum(len(x) - 1 for x in big)}
    right = [s.logprob for s in hf.score(big, 1, None, len(big), "right")[:n]]
    left = [s.logprob for s in hf.score(big, 1, None, len(big), "left")[:n]]
    out = {
        # from the micro-batch the comparison used (base: its values) to the large one
        "micro_batch": {**gap(cut(base), cut(right)), "from": hf_batch_size, **size},
        "padding_side": {**gap(cut(right), cut(left)), **size},
    }
    skipped: dict[str, str] = {}
    # one row holds the texts and the other prompts (a trainer packs to its row length)
    packed = hf.score_packed(seqs + others, max(large_positions(device), sum(map(len, seqs + others))))
    if isinstance(packed, str):
        skipped["packed"] = packed
    else:
        out["packed"] = {**gap(cut(base), cut([s.logprob for s in packed[:n]])), "rows_of": len(seqs) + len(others)}
    chunk = max(1, min(CHUNK, min(len(x) - s for x, s in zip(seqs, starts)) // 2))
    chunked = hf.rollout_score(seqs, starts, chunk=chunk)
    out["chunked_kv"] = {**gap(cut(base), [c["logprob"] for c in chunked]), "chunk": chunk}
    for k, v in out.items():
        v["words"] = variation_words(k, v)
    return out, skipped


def floor_rows(variations: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The variations as a rollout's or a rescore's floor rows (`side`, `in_floor`, `what`), the
    skipped ones with their reason, so the rollout views read them beside their own rows."""
    rows = {k: {**v, "side": "hf", "in_floor": True, "what": "HF " + variation_when(k, v)} for k, v in variations.items()}
    for k, why in skipped.items():
        rows[k] = {"mean": None, "max": None, "n": 0, "side": "hf", "in_floor": True, "what": f"not measured: {why}"}
    return rows


def floor_of(variations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The floor from measured variations: the largest mean, the variation that set it, and its words.
    Nothing measured gives a floor of None (not 0)."""
    got = {k: v for k, v in variations.items() if k in VARIATIONS and v.get("mean") is not None}
    if not got:
        return {"hf_noise_mean": None, "hf_noise_max": None, "noise_set_by": None, "noise_words": None, "noise_measured": ""}
    key = max(got, key=lambda k: (got[k]["mean"], -VARIATIONS.index(k)))
    words = got[key].get("words") or variation_words(key, got[key])
    if got[key]["mean"] == 0:  # nothing moved: say so, not "HF moves 0 when ..."
        words = "HF gave the same values, bit for bit, " + "; ".join(variation_when(k, got[k]) for k in VARIATIONS if k in got)
    return {
        "hf_noise_mean": got[key]["mean"],
        "hf_noise_max": max(v["max"] for v in got.values()),
        "noise_set_by": key,
        "noise_words": words,
        "noise_measured": ",".join(k for k in VARIATIONS if k in got),
    }


def measure(
    vllm: Any,
    hf: Any,
    seqs: list[list[int]],
    scores: dict[str, list[Any]],
    others: list[list[int]],
    hf_batch_size: int,
    device: str = "cuda",
) -> dict[str, Any]:
    """The floor on the first sequences of a scored batch (`scores`: each side's values of `seqs`),
    by the engines' hosts the comparison used: HF's variations, and vLLM's own noise beside them."""
    n = sample_of(seqs, device)
    sample = [list(s) for s in seqs[:n]]
    main_v = [s.logprob for s in scores["vllm"][:n]]
    main_h = [s.logprob for s in scores["hf"][:n]]
    t = time.perf_counter()
    variations, skipped = hf_variations(hf, sample, main_h, others, device, hf_batch_size=hf_batch_size)
    t_hf = time.perf_counter() - t
    # one text alone was already scored alone: the batched-with-others call is its floor then
    v_alone = [s.logprob for s in vllm.score(sample, 1, None, 1)] if len(seqs) > 1 else main_v
    v_batched = [s.logprob for s in vllm.score(sample + others, 1)[:n]]
    t_v = time.perf_counter() - t - t_hf
    v1, v2 = gap(main_v, v_alone), gap(main_v, v_batched)
    means = [g["mean"] for g in (v1, v2) if g["mean"] is not None]
    maxes = [g["max"] for g in (v1, v2) if g["max"] is not None]
    measured = [k for k in VARIATIONS if k in variations]
    return {
        **floor_of(variations),
        "variations": variations,
        "skipped": skipped,
        "vllm_noise_mean": max(means) if means else None,
        "vllm_noise_max": max(maxes) if maxes else None,
        "noise_tokens": variations["micro_batch"]["n"],
        "noise_texts": n,
        "seconds": {"hf": round(t_hf, 3), "vllm": round(t_v, 3)},
        "noise_what": (
            f"HF against itself on {n} of the texts ({variations['micro_batch']['n']} tokens): "
            + ", ".join(variation_when(k, variations[k]) for k in measured)
            + "".join(f"; not measured: {k.replace('_', ' ')} ({why})" for k, why in skipped.items())
            + f". vLLM against itself: the same texts each alone, and batched with {len(others)} other prompts"
        ),
    }


def with_ratio(floor: dict[str, Any] | None, mean_abs_delta: float | None) -> dict[str, Any]:
    """The floor's summary keys (FLOOR_KEYS), with noise_ratio = the mean gap over the floor (None
    when the floor measured 0: nothing to divide by); every key None when not measured. Floors stored
    before the definition (one batched pass) keep their value and say so."""
    if not floor:
        return dict.fromkeys(FLOOR_KEYS)
    out = {k: floor.get(k) for k in FLOOR_KEYS}
    if out["noise_set_by"] is None and out["hf_noise_mean"] is not None:
        out["noise_words"] = floor.get("noise_what") or "HF batched and padded against itself"
    hn = floor.get("hf_noise_mean")
    out["noise_ratio"] = mean_abs_delta / hn if (mean_abs_delta is not None and hn) else None
    return out
