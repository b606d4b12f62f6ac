"""One batch of texts scored by both engines and compared: the pieces a comparison's batch is made
of, shared by the engines side by side (analysis.compare) and in turn (analysis.turns).

vLLM scores first (`vllm_side`), its full rows going to the exact KL's exchange; HF then scores the
same ids, gathering its values on vLLM's top-k ids (`hf_side`); `assemble` makes the batch's table,
its part's info and its metrics, with the floor when the batch holds the floor's texts
(`measure_floor`). An MoE model's routes are compared on the first texts (`routes_compared`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from logprob_parity.analysis import floors
from logprob_parity.analysis.request import Prepared
from logprob_parity.engines.pool import Lease
from logprob_parity.engines.routing import VLLM_CAPTURE, VLLM_OWN, compare_routes
from logprob_parity.results.positions import batch_table


def describe(p: Prepared, lo: int, hi: int) -> Any:
    """The texts' token names and pieces, made while the engines score (no engine waits on them)."""
    return BESIDE.submit(lambda: [p.tokenized(i) for i in range(lo, hi)])


def assemble(
    p: Prepared,
    lo: int,
    hi: int,
    digest: str,
    described: Any,
    scores: dict[str, list[Any]],
    info_b: dict[str, Any],
    why_b: str | None,
    via_b: set[str],
    floor_job: Any,
) -> tuple[Any, dict[str, Any], Any]:
    """A scored batch's table, its part's info and its metrics: the same whether the engines scored it
    side by side or in turn (analysis.turns)."""
    try:
        table, part_infos, m = batch_table(described.result(), scores["hf"], scores["vllm"], p.decode_many, lo)
    finally:  # the engines measured their own noise while this process built the table (never left running)
        measured = floor_job.result() if floor_job is not None else None
    floor = None
    if measured is not None:
        floor, info_b["timing"]["noise_s"] = measured
    info = {
        "lo": lo,
        "hi": hi,
        "ids": digest,
        "sequences": [asdict(x) for x in part_infos],
        "engines": info_b["engines"],
        "kl_why": {why_b: 1} if why_b else {},
        "via": sorted(via_b),
        "floor": floor,
        "timing": info_b["timing"],
    }
    return table, info, m


def measure_floor(
    p: Prepared,
    dtype: str,
    requests: list[Any],
    lease: Lease,
    seqs: list[list[int]],
    scores: dict[str, list[Any]],
    vllm_own: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], float]:
    """Each engine's own noise on a scored batch's first texts (logprob_parity.analysis.floors), on a device
    turn of its own: (the floor, seconds). vllm_own: vLLM's noise measured in its own turn
    (floors.vllm_noise), when the engines run in turn and the lease holds HF alone."""
    ctx, spec = p.ctx, p.spec
    vreq, hreq = requests
    vhost, hhost = (vllm_own if vllm_own is not None else lease.host(vreq)), lease.host(hreq)
    t = time.perf_counter()
    with ctx.pool.device_turn(ctx.waiter(dtype), what="the noise floor"):
        ctx.emit(
            "noise",
            dtype,
            f"each engine against itself on {floors.sample_of(seqs, p.device)} of the texts "
            "(HF: micro-batch, padding side, packed, chunked through its KV cache; vLLM: alone and batched)",
        )
        others = floors.other_prompts(p.tokenizer, spec.bos, vreq.max_model_len, p.device)
        floor = lease.call(
            hreq if vllm_own is not None else vreq,
            lambda: floors.measure(vhost, hhost, seqs, scores, others, hreq.settings.hf_batch_size, p.device),
        )
    return floor, time.perf_counter() - t


ROUTING_TOKENS = 8192  # positions of the first texts whose MoE routing is compared, at most


def routing_texts(seqs: list[list[int]]) -> int:
    """How many of the first texts the routing covers: up to ROUTING_TOKENS positions, at least one."""
    n, used = 0, 0
    for s in seqs:
        if n and used + len(s) > ROUTING_TOKENS:
            break
        n, used = n + 1, used + len(s)
    return n


def routes_compared(p: Prepared, hf: Any, vl: Any, seqs: list[list[int]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both sides' routes (or vLLM's reason it has none), compared set by set: (what was measured,
    each sequence's comparison)."""
    if isinstance(vl, str):
        return {"measured": False, "why": vl}, []
    n = routing_texts(seqs)
    used = sum(len(s) for s in seqs[:n])
    per = [compare_routes(a, b) for a, b in zip(vl, hf)]
    return {
        "measured": True,
        "texts": n,
        "tokens": used,
        "layers": per[0]["layers"] if per else 0,
        "top_k": int(hf[0].shape[-1]) if hf else 0,
        # the vLLM backend starts an MoE model's GPU engine with vLLM's own option (routing.vllm_source)
        "vllm_from": VLLM_CAPTURE if p.device == "cpu" else VLLM_OWN,
        "hf_from": "each MoE layer's router logits, top-k",
    }, per


# Work done beside the engines: describing a batch's texts while they score it, and measuring the
# noise floor while this process builds the batch's table.
BESIDE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lpp-beside")


def batch_words(b: int, n_batches: int) -> str:
    return f" (batch {b + 1} of {n_batches})" if n_batches > 1 else ""


def vllm_side(
    p: Prepared, dtype: str, vreq: Any, lease: Lease, vhost: Any, seqs: list[list[int]], ex: Any, where: str
) -> tuple[list[Any], float]:
    """vLLM scores a batch, its full rows to the exchange `ex`: (its scores, seconds)."""
    p.ctx.emit("score", dtype, f"vllm: {sum(map(len, seqs)):,} tokens{where}")
    t = time.perf_counter()
    got = lease.call(vreq, lambda: vhost.score(seqs, p.spec.top_k, None, None, "right", ex.vllm_target))
    ex.after_vllm(vhost)
    return got, time.perf_counter() - t


def hf_side(
    p: Prepared, dtype: str, hreq: Any, lease: Lease, hhost: Any, seqs: list[list[int]], ex: Any, vllm: list[Any], where: str
) -> tuple[list[Any], float]:
    """HF scores the batch vLLM scored, gathering its own values on vLLM's top-k ids and taking the
    exact KL against vLLM's rows in `ex`: (its scores, seconds)."""
    gather = [s.topk_ids for s in vllm]
    p.ctx.emit("score", dtype, f"hf: {sum(map(len, seqs)):,} tokens{where}")
    t = time.perf_counter()
    got = lease.call(hreq, lambda: hhost.score(seqs, p.spec.top_k, gather, None, "right", ex.hf_source))
    return got, time.perf_counter() - t
