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
it ("HF moves 3e-3 when its micro-batch changes from 1 to 32 sequences"). A mean is compared with a
mean only: a token is judged against the noise's *tail*, the largest of the variations' TAIL_Q
quantiles of the per-token |Δ logp| (`hf_noise_tail`), estimated on at least TAIL_MIN_POSITIONS
positions (a short sample is topped up with the bundled sentences, so the quantile means something),
and argmax flips against HF's own argmax flips under the same variations (`hf_noise_flip_frac`).
Why: compared with the mean, about half the tokens of pure noise read as beyond it. Compare measures it on a
sample of its texts (the first, up to noise_tokens(device) positions and a twentieth of its own): the
cheap part. Diagnostics
measures it on every text, and takes the comparison's own values when the sample already held every
text, so both pages judge against one number. vLLM's own noise (alone against batched) is measured
beside it and shown; the verdict judges against HF's, the trainer's side, whose values an RL loss
holds fixed. A floor that is not measured is said to be so; it is never taken as 0.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.errors import UserError
from logprob_parity.inputs.tokens import encode_texts
from logprob_parity.results.bands import TAIL_MIN_POSITIONS, TAIL_Q, VARIATIONS, tail_of, tail_words  # noqa: F401 - their home

# in each run's identity: a run measured by another definition is another run
DEFINITION = "hf:" + ",".join(VARIATIONS) + ";tail:envelope,q995,min400,others10,topup10+30,fill:longest;chunk:per-text"
OTHER_PROMPTS = 10  # other prompts beside the sample: packed with it, in its batch on a GPU, and topping a short one up
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
    "hf_noise_tail",
    "noise_tail_q",
    "noise_tail_positions",
    "noise_tail_beyond",
    "hf_noise_flip_frac",
    "noise_flip_positions",
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
    """The bundled prompts as token ids, those that fit the engines' context: the OTHER_PROMPTS
    sentences first (the ones a batch or a packed row holds beside the sample: `near`), then texts of
    other kinds (code, numbers, other scripts, emoji), whose noise differs: a short sample is topped up
    with all of them, in this order, to TAIL_MIN_POSITIONS (top_up). Only the sentences go into the
    batches: each text there costs every variation a row (0.19 s -> 1.46 s of a 1.1B compare's floor
    on an H100 when all 40 did)."""
    data = Path(__file__).resolve().parent.parent / "data"
    lines = data.joinpath("sentences.txt").read_text().splitlines()[:OTHER_PROMPTS]
    lines += [x for x in data.joinpath("noise_texts.txt").read_text(encoding="utf-8").splitlines() if x.strip()]
    ids, _ = encode_texts(tokenizer, lines, bos)
    return [x for x in ids if len(x) < max_len]


def near(others: list[list[int]]) -> list[list[int]]:
    """The other prompts that share a batch or a packed row with the sample (other_prompts' sentences)."""
    return others[:OTHER_PROMPTS]


SAMPLE_SHARE = 20  # the sample holds at most 1/20 of the comparison's positions (at least one text)


def sample_of(seqs: list[list[int]], device: str = "cuda") -> int:
    """How many of the first sequences the floor is measured on: up to noise_tokens(device)
    positions and 1/SAMPLE_SHARE of the comparison's, but up to TAIL_MIN_POSITIONS where it has them
    (the tail is read on the comparison's own texts first: CJK or code move more than English), at
    least one text. Its four variations cost about four passes of HF over the sample, so the floor
    stays a small share of a large comparison."""
    total = sum(len(s) - 1 for s in seqs)
    # at least TAIL_MIN_POSITIONS of the comparison's own (where it has them): the tail is read on them
    n, used, cap = 0, 0, max(min(noise_tokens(device), total // SAMPLE_SHARE), min(TAIL_MIN_POSITIONS, total))
    for s in seqs:
        if n and used + len(s) - 1 > cap:
            break
        n += 1
        used += len(s) - 1
    return n


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
    """|a - b| over positions both sides scored: mean, max, the tail (the TAIL_Q quantile; the
    largest value where fewer than TAIL_MIN_POSITIONS positions make a quantile meaningless), and how many."""
    d = np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) for x, y in zip(a, b)])
    d = d[np.isfinite(d)]
    if d.size == 0:
        return {"mean": None, "max": None, "tail": None, "n": 0}
    t = tail_value(d)
    # beyond_tail: how many of these positions lie beyond their own tail (about 1%): what noise puts there
    return {"mean": float(d.mean()), "max": float(d.max()), "tail": t, "beyond_tail": int((d > t).sum()), "n": int(d.size)}


def tail_value(d: np.ndarray) -> float:
    """The TAIL_Q quantile of per-token gaps (never interpolated below an observed value), or the
    largest one where there are too few positions for that quantile to mean something."""
    d = np.asarray(d, np.float64)
    if d.size < TAIL_MIN_POSITIONS:
        return float(d.max())
    return float(np.quantile(d, TAIL_Q, method="higher"))


def flips(a: list[np.ndarray], b: list[np.ndarray], starts: list[int]) -> dict[str, int]:
    """How many positions (from each start on) have another most likely next token in b than in a."""
    k = n = 0
    for x, y, s in zip(a, b, starts):
        x, y = np.asarray(x)[s:], np.asarray(y)[s:]
        ok = (x >= 0) & (y >= 0)
        k += int((x[ok] != y[ok]).sum())
        n += int(ok.sum())
    return {"flips": k, "flip_n": n}


def _top1(scores: list[Any]) -> list[np.ndarray]:
    """Each scored sequence's most likely id at each position (-1 where not known)."""
    out = []
    for s in scores:
        ids = getattr(s, "topk_ids", None)
        if ids is None:
            out.append(np.full(len(s.logprob), -1))
            continue
        ids = np.asarray(ids)
        out.append(ids[:, 0] if ids.ndim == 2 else ids)
    return out


def filled(seqs: list[list[int]], others: list[list[int]], positions: int) -> list[list[int]]:
    """The large batch: the texts, each other prompt once (at least one row more, so it is a batch
    even for one long text), then the longest texts over again until `positions` positions. A padded
    batch costs its longest text a row: short prompts repeated to the target cost 18x their positions
    (144 rows of 512 for 4,100 positions on an H100: 0.46 s a pass)."""
    out = [list(s) for s in seqs] + [list(o) for o in others]
    every = out or [[0]]
    longest = max(map(len, every))
    pool = [s for s in every if 2 * len(s) >= longest]  # rows at least half the longest: little padding
    k = 0
    while len(out) <= len(seqs) or sum(len(x) - 1 for x in out) < positions:
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
        return f"when it scores up to {v.get('chunk', CHUNK)} tokens a forward through its KV cache"
    if key == "envelope":
        return "at its largest under any of these variations, token by token (where the noise's tail is read)"
    return "when " + key.replace("_", " ")


class Bundled:
    """HF's values of the bundled texts that top a short sample up (top_up), kept per loaded engine.

    Why: they are the same ids on every comparison, and on a CPU scoring them one a forward (the
    comparison's own micro-batch of one) and chunk by chunk through the KV cache was most of a short
    text's floor (the demo model in float32: about 7 of 17 s). Each of those forwards holds one text
    alone: nothing of the comparison shares it, so a second pass on the same loaded engine repeats the
    first one's arithmetic. Kept per text, per host and model load (`address`, `loads`): another
    engine, a swapped model or a restarted host measures them again. A host that is not an engine host
    (no `address`) keeps nothing. `warm` fills them ahead (the dashboard's prewarm), so the first Run
    of a demo pays only for its own text."""

    MAX = 4096  # entries (a text's values: some KB); the oldest go first

    def __init__(self) -> None:
        self._got: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()  # the dashboard's jobs measure floors in threads of one process

    def each(self, hf: Any, what: tuple[Any, ...], texts: list[list[int]], compute: Any) -> list[Any]:
        """Each text's values under `what`: those kept, and compute(the others) for the rest, in one call."""
        address = getattr(hf, "address", None)
        if address is None:
            return list(compute(texts)) if texts else []
        keys = [(address, getattr(hf, "loads", 0), *what, tuple(t)) for t in texts]
        with self._lock:
            got = [self._got.get(k) for k in keys]
        missing = [i for i, g in enumerate(got) if g is None]
        if missing:
            values = list(compute([texts[i] for i in missing]))  # outside the lock: it is the engine's work
            with self._lock:
                for i, value in zip(missing, values):
                    got[i] = self._got[keys[i]] = value
                while len(self._got) > self.MAX:
                    self._got.pop(next(iter(self._got)))
        return got

    def alone(self, hf: Any, texts: list[list[int]]) -> list[Any]:
        """HF's scores of each text alone (a micro-batch of one)."""
        return self.each(hf, ("alone",), texts, lambda xs: hf.score(xs, 1, None, 1))

    def chunked(self, hf: Any, texts: list[list[int]], chunk: int) -> list[Any]:
        """Each text fed `chunk` tokens a forward through HF's KV cache, every position scored."""
        return self.each(hf, ("chunked", chunk), texts, lambda xs: hf.rollout_score(xs, [1] * len(xs), chunk=chunk))

    def warm(self, hf: Any, others: list[list[int]]) -> None:
        """Score every bundled text that top_up may add, alone and chunked, on this engine now: those
        it takes for a sample of no positions (taken), not the rest, which no floor adds (on the demo
        model 21 of the 40 texts, 424 of their 995 positions)."""
        may = taken(others, 0)
        self.alone(hf, may)
        for c in sorted({chunk_of(len(o) - 1) for o in may}):
            self.chunked(hf, [o for o in may if chunk_of(len(o) - 1) == c], c)


BUNDLED = Bundled()


def taken(others: list[list[int]], have: int) -> list[list[int]]:
    """The bundled texts top_up adds to a sample of `have` positions: the first of them, in order,
    until the sample holds TAIL_MIN_POSITIONS (each counts its positions after the first token)."""
    add: list[list[int]] = []
    for o in others:
        if have >= TAIL_MIN_POSITIONS:
            break
        add.append(list(o))
        have += len(o) - 1
    return add


def top_up(
    hf: Any,
    seqs: list[list[int]],
    base: list[np.ndarray],
    starts: list[int],
    others: list[list[int]],
    hf_batch_size: int,
    base_top1: list[np.ndarray] | None,
) -> tuple[list[list[int]], list[np.ndarray], list[int], list[np.ndarray], int]:
    """The sample with other texts added while it holds fewer than TAIL_MIN_POSITIONS positions, so
    the noise's tail rests on enough positions; each added text scored by HF in the comparison's own
    micro-batch size (its base). Returns (texts, base, starts, base argmax ids (-1: unknown), texts added)."""
    top1 = list(base_top1) if base_top1 is not None else [np.full(len(s), -1) for s in seqs]
    add = taken(others, sum(max(len(x) - s, 0) for x, s in zip(seqs, starts)))
    if not add:
        return list(seqs), list(base), list(starts), top1, 0
    bs = max(1, hf_batch_size)
    scored = BUNDLED.alone(hf, add) if bs == 1 else hf.score(add, 1, None, bs)
    return (
        [*seqs, *add],
        [*base, *(np.asarray(x.logprob, np.float64) for x in scored)],
        [*starts, *([1] * len(add))],
        [*top1, *_top1(scored)],
        len(add),
    )


def hf_variations(
    hf: Any,
    seqs: list[list[int]],
    base: list[np.ndarray],
    others: list[list[int]],
    device: str,
    starts: list[int] | None = None,
    hf_batch_size: int = 1,
    base_top1: list[np.ndarray] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each variation of the definition on `seqs` (hf: an HF engine host; base: the values the
    comparison's HF gave them in its micro-batch of hf_batch_size sequences, per position with NaN
    where unscored; base_top1: its most likely ids, when known). Each variation is against base,
    padding_side against the same large batch padded on the right. Gaps count positions from `starts`
    on (a rollout's completion; 1 = every scored position). A sample of fewer than TAIL_MIN_POSITIONS
    positions is topped up with `others` first (top_up). Each variation carries its mean, max, tail
    (TAIL_Q quantile), positions and, where both sides' argmax ids are known, its argmax flips.
    Returns (measured variations, skipped: key -> why)."""
    starts = list(starts) if starts is not None else [1] * len(seqs)
    seqs, base, starts, top1, added = top_up(hf, seqs, base, starts, others, hf_batch_size, base_top1)
    n = len(seqs)

    def cut(arrs: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(a, np.float64)[s:] for a, s in zip(arrs, starts)]

    # a padded batch costs its longest text a row: on a CPU, one other prompt in it (packing wastes nothing)
    beside = near(others)
    in_batch = beside if str(device).startswith("cuda") else others[:OTHER_PROMPTS_CPU]
    big = filled(seqs, in_batch, large_positions(device))
    size = {"to": len(big), "positions": sum(len(x) - 1 for x in big), "texts": n, "texts_added": added}
    out: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    try:
        right_s = hf.score(big, 1, None, len(big), "right")[:n]
        left_s = hf.score(big, 1, None, len(big), "left")[:n]
    except UserError as exc:  # a long text pads every row of the batch to its length: its logits may not fit
        if "out of memory" not in str(exc):
            raise
        why = f"the large batch ({len(big)} texts padded to {max(map(len, big)):,} tokens) did not fit in the device's memory"
        skipped["micro_batch"] = skipped["padding_side"] = why
    else:
        right, left = [s.logprob for s in right_s], [s.logprob for s in left_s]
        # from the micro-batch the comparison used (base: its values) to the large one
        out["micro_batch"] = {**gap(cut(base), cut(right)), "from": hf_batch_size, **size, **flips(top1, _top1(right_s), starts)}
        out["padding_side"] = {**gap(cut(right), cut(left)), **size, **flips(_top1(right_s), _top1(left_s), starts)}
    # one row holds the texts and the other prompts (a trainer packs to its row length)
    packed = hf.score_packed(seqs + beside, max(large_positions(device), sum(map(len, seqs + beside))))
    if isinstance(packed, str):
        skipped["packed"] = packed
    else:
        out["packed"] = {
            **gap(cut(base), cut([s.logprob for s in packed[:n]])),
            "rows_of": len(seqs) + len(beside),
            "texts": n,
            **flips(top1, _top1(packed[:n]), starts),
        }
    # each text in chunks of at most CHUNK tokens and at most half its scored length (at least two a text)
    chunks = [chunk_of(len(x) - s) for x, s in zip(seqs, starts)]
    chunked: list[Any] = [None] * n
    # texts [0, own) are the sample's own; [own, n) the bundled ones top_up added, the same ids every run (BUNDLED keeps theirs)
    own = n - added
    for c in sorted(set(chunks)):
        idx = [i for i in range(own) if chunks[i] == c]
        if idx:
            for i, got in zip(idx, hf.rollout_score([seqs[i] for i in idx], [starts[i] for i in idx], chunk=c)):
                chunked[i] = got
        idx = [i for i in range(own, n) if chunks[i] == c]
        for i, got in zip(idx, BUNDLED.chunked(hf, [seqs[i] for i in idx], c)):
            chunked[i] = got
    values = {
        **({"micro_batch": cut(right), "padding_side": cut(left)} if "micro_batch" in out else {}),
        "chunked_kv": [c["logprob"] for c in chunked],
        **({"packed": cut([s.logprob for s in packed[:n]])} if "packed" in out else {}),
    }
    out["chunked_kv"] = {**gap(cut(base), values["chunked_kv"]), "chunk": max(chunks), "texts": n}
    out["envelope"] = {**envelope(cut(base), values.get("micro_batch", []), values), "texts": n, "texts_added": added}
    for k, v in out.items():
        if v.get("flip_n") == 0:  # no argmax known on one side: not measured, not 0
            v.pop("flips"), v.pop("flip_n")
        v["words"] = variation_words(k, v)
    return out, skipped


def chunk_of(scored: int) -> int:
    """chunked_kv's chunk for a text of `scored` positions: CHUNK, at most half of them, at least 1."""
    return max(1, min(CHUNK, scored // 2))


def envelope(base: list[np.ndarray], right: list[np.ndarray], values: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    """At each position, the most HF moved under any variation (each against its own reference: base,
    padding_side against the right-padded batch), and gap()'s figures of that: the noise's tail is this
    envelope's TAIL_Q quantile, so a single variation's own noise (the null comparison's) lies within it."""
    per = []
    for k, vals in values.items():
        ref = right if k == "padding_side" else base
        per.append(np.concatenate([np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) for a, b in zip(ref, vals)]))
    env = np.nanmax(np.vstack(per), axis=0) if per else np.zeros(0)
    zero = [np.zeros(len(env))]
    return gap(zero, [env])


def floor_rows(variations: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The variations as a rollout's or a rescore's floor rows (`side`, `in_floor`, `what`), the
    skipped ones with their reason, so the rollout views read them beside their own rows."""
    rows = {
        k: {**v, "side": "hf", "in_floor": k in VARIATIONS, "what": "HF " + variation_when(k, v)} for k, v in variations.items()
    }
    for k, why in skipped.items():
        rows[k] = {"mean": None, "max": None, "n": 0, "side": "hf", "in_floor": True, "what": f"not measured: {why}"}
    return rows


def floor_of(variations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The floor from measured variations: the largest mean, the variation that set it, and its words.
    Nothing measured gives a floor of None (not 0)."""
    got = {k: v for k, v in variations.items() if k in VARIATIONS and v.get("mean") is not None}
    if not got:
        return {
            "hf_noise_mean": None,
            "hf_noise_max": None,
            "noise_set_by": None,
            "noise_words": None,
            "noise_measured": "",
            **tail_of(variations),
        }
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
        **tail_of(variations),
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
    by the engines' hosts the comparison used: HF's variations, and vLLM's own noise beside them.
    vllm: its host, or what `vllm_noise` measured earlier (engines in turn: vLLM has left the device)."""
    n = sample_of(seqs, device)
    sample = [list(s) for s in seqs[:n]]
    main_v = [s.logprob for s in scores["vllm"][:n]]
    t = time.perf_counter()
    variations, skipped = hf_variations(
        hf,
        sample,
        [x.logprob for x in scores["hf"][:n]],
        others,
        device,
        hf_batch_size=hf_batch_size,
        base_top1=_top1(scores["hf"][:n]),
    )
    t_hf = time.perf_counter() - t
    own = vllm if isinstance(vllm, dict) else vllm_noise(vllm, seqs, main_v, others, device)
    measured = [k for k in VARIATIONS if k in variations]
    added = variations["envelope"]["texts_added"]
    positions = variations.get("micro_batch", variations["envelope"])["n"]  # the sample's positions, from each start on
    return {
        **floor_of(variations),
        "variations": variations,
        "skipped": skipped,
        "vllm_noise_mean": own["mean"],
        "vllm_noise_max": own["max"],
        "noise_tokens": positions,
        "noise_texts": n,
        "seconds": {"hf": round(t_hf, 3), "vllm": round(own["seconds"], 3)},
        "noise_what": (
            f"HF against itself on {n} of the texts"
            + (f" and {added} bundled sentences (so the tail rests on enough tokens)" if added else "")
            + f" ({positions} tokens): "
            + ", ".join(variation_when(k, variations[k]) for k in measured)
            + "".join(f"; not measured: {k.replace('_', ' ')} ({why})" for k, why in skipped.items())
            + f". vLLM against itself: the same texts each alone, and batched with {len(near(others))} other prompts"
        ),
    }


def vllm_noise(
    vllm: Any, seqs: list[list[int]], main_v: list[Any], others: list[list[int]], device: str = "cuda"
) -> dict[str, Any]:
    """vLLM against itself on the floor's sample of `seqs` (main_v: the comparison's vLLM values of
    them): each text alone and the texts batched with other prompts. {"mean", "max", "seconds"}, the
    larger of the two; `measure` takes it in place of the host when vLLM ran in its own turn."""
    n = sample_of(seqs, device)
    sample = [list(s) for s in seqs[:n]]
    main_v = list(main_v[:n])
    t = time.perf_counter()
    # one text alone was already scored alone: the batched-with-others call is its floor then
    v_alone = [s.logprob for s in vllm.score(sample, 1, None, 1)] if len(seqs) > 1 else main_v
    v_batched = [s.logprob for s in vllm.score(sample + near(others), 1)[:n]]
    v1, v2 = gap(main_v, v_alone), gap(main_v, v_batched)
    means = [g["mean"] for g in (v1, v2) if g["mean"] is not None]
    maxes = [g["max"] for g in (v1, v2) if g["max"] is not None]
    return {
        "mean": max(means) if means else None,
        "max": max(maxes) if maxes else None,
        "seconds": time.perf_counter() - t,
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
