"""Rollout mode: vLLM's decode path (what an RL rollout samples with) against the trainer's scoring.

For each dtype:
1. vLLM samples every (prompt, seed) request in one generate call, recording each sampled token's
   decode-time logprob raw and, when temperature or top-k/top-p change it, processed (a second pass
   with the same seeds; the tokens must come out the same).
2. vLLM prefill (prompt_logprobs) rescores prompt+completion ids; HF rescores them teacher-forced
   (the trainer), also at the sampling temperature, with the mass top-k/top-p keep.
3. Three pairs per token and per sequence (logprob_parity.results.rollout.PAIRS) and the RL mismatch
   metrics (logprob_parity.results.offpolicy).
4. Noise floors: the same seeded samples decoded alone (decode batch size); HF's floor by the one
   definition every view uses (logprob_parity.analysis.floors: micro-batch, padding side, packed,
   chunked through the KV cache), and beside it HF one token a forward.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from logprob_parity.analysis import floors as floors_def
from logprob_parity.analysis import turns
from logprob_parity.analysis.request import Context, Prepared, model_max_len, prepare, say_loading
from logprob_parity.analysis.verdict import rollout_verdict
from logprob_parity.engines import fullvocab
from logprob_parity.engines.records import LoadRequest
from logprob_parity.engines.routing import NOT_MOE, VLLM_OWN, compare_routes, routing_summary
from logprob_parity.env import device_name, resolve_device, versions
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import RunSpec, content_hash
from logprob_parity.inputs.tokens import decode_tail_pieces
from logprob_parity.results.offpolicy import floor_stats, mismatch_metrics
from logprob_parity.results.rollout import (
    COLUMNS,
    MAIN_PAIR,
    PAIRS,
    ROLLOUT_SCHEMA,
    Rollout,
    RolloutMeta,
    Sample,
    Sampling,
    exact_stats,
    hf_floor,
    with_bands,
)

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
ROUTING_DEFINITION = "decode steps vs HF teacher-forced, every completion token; replay with the decode's experts"
NOISE_SAMPLES = 2  # seeded samples re-decoded alone and rescored in chunks / token by token
# The floors' costs, kept below the rollout's own (a per-token loop over every token of a long
# completion took ten times the rollout): the re-decoded samples stop after this many tokens (the
# same seed gives the same first tokens alone as in the batch), and the one-token-a-forward loop
# scores the last this many tokens of each sample, after their prefix in one forward.
NOISE_DECODE_TOKENS = 128
INCREMENTAL_TOKENS = 64
STEPS_PER_DTYPE = 8  # progress steps: load, sample, (processed), prefill, hf, floors x3


def _identity(p: Prepared, sampling: Sampling, dtype: str, noise: int) -> dict[str, Any]:
    v = versions()
    return {
        "schema": ROLLOUT_SCHEMA,
        "kind": "rollout",
        "model": p.model.identity,
        "dtype": dtype,
        "settings": p.spec.settings.run_id_part(),
        "bos": p.spec.bos,
        "sampling": sampling.to_dict(),
        "noise": noise,
        **({"noise_floor": floors_def.DEFINITION} if noise else {}),
        "routing": ROUTING_DEFINITION,  # an MoE model's decode routes and their replay (_decode_routing)
        "versions": {k: v[k] for k in ("torch", "transformers", "vllm")},
        "device": device_name(p.device),
        "texts": list(p.spec.texts),
        "truncate": p.spec.truncate,
    }


def rollout_id_for(p: Prepared, sampling: Sampling, dtype: str, noise: int) -> str:
    """Content address of a rollout request: the model, dtype, engine settings, prompts, versions
    and every sampling setting, the seed included (a seeded rollout is reproducible)."""
    return content_hash(_identity(p, sampling, dtype, noise))


def rollout(
    spec: RunSpec, sampling: Sampling, ctx: Context | None = None, use_cache: bool = True, noise_samples: int = NOISE_SAMPLES
) -> list[Rollout]:
    """One stored Rollout per dtype of `spec`, in order; stored ones come back without an engine."""
    ctx = ctx or Context.of()
    sampling.validate()
    spec = with_rollout_defaults(spec)
    p = prepare(spec, ctx)
    out = []
    for dtype in p.spec.dtypes:
        rid = rollout_id_for(p, sampling, dtype, noise_samples)
        if use_cache and ctx.store.has_rollout(rid):
            ctx.emit("cache", dtype, f"rollout {rid} from the store, no engine started")
            out.append(ctx.store.load_rollout(rid))
            continue
        r = _rollout_dtype(p, sampling, dtype, rid, noise_samples)
        ctx.store.save_rollout(r)
        ctx.emit("store", dtype, f"rollout {rid} saved")
        out.append(r)
    return out


def with_rollout_defaults(spec: RunSpec) -> RunSpec:
    """The settings a rollout leaves unset, resolved for the device in use; the resolved values are
    what the run id and the record hold. enforce_eager: a rollout engine decodes with CUDA graphs,
    as RL rollouts do, so unset becomes False on a GPU; on a CPU there are no CUDA graphs and
    compiling costs minutes, so True. The trainer side's as in `with_trainer_defaults`."""
    spec = with_trainer_defaults(spec)
    if spec.settings.enforce_eager is not None:
        return spec
    eager = resolve_device(spec.device) == "cpu"
    return dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, enforce_eager=eager))


def with_trainer_defaults(spec: RunSpec) -> RunSpec:
    """hf_cudnn_attention left unset becomes False on a GPU, for the trainer side of a rollout or a
    rescore. That side scores padded batches whose widths are new in every rollout, and cuDNN
    attention plans each new shape: on the H200 that planning took 1.9 s of a 64 x 512 rollout's
    HF side, against 0.3 s for the whole side without it (benchmarks/results/rollout_h200.md).
    Set it to True to keep torch's choice."""
    if spec.settings.hf_cudnn_attention is not None or resolve_device(spec.device) == "cpu":
        return spec
    return dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, hf_cudnn_attention=False))


def _engines(p: Prepared, dtype: str, sampling: Sampling) -> tuple[LoadRequest, LoadRequest]:
    toks = p.toks
    longest = max(len(t.token_ids) for t in toks) + sampling.max_tokens
    limit = p.model.max_positions
    if limit is not None and longest > limit:
        raise UserError(
            f"a prompt plus {sampling.max_tokens} new tokens is {longest} tokens, but {p.model.name} has {limit} "
            "positions; lower max tokens or shorten the prompt"
        )
    mml = model_max_len(longest, limit)
    return (
        LoadRequest("vllm", p.model.path, dtype, p.device, p.spec.settings, mml),
        LoadRequest("hf", p.model.path, dtype, p.device, p.spec.settings, mml),
    )


def _rollout_dtype(p: Prepared, sampling: Sampling, dtype: str, rid: str, noise: int) -> Rollout:
    ctx = p.ctx
    t_all = time.perf_counter()
    ctx.emit("tokenize", None, f"{len(p.spec.texts)} prompt(s)")
    vreq, hreq = _engines(p, dtype, sampling)
    timing: dict[str, float] = {}
    in_turn: dict[str, str] = {}  # the engine record's words when the engines ran in turn
    sample: tuple[int, int] | None = None  # in turn past the spool's bound: the exact KL's rows kept
    if ctx.ray is not None:
        from logprob_parity.analysis.cluster import open_cluster

        with open_cluster(ctx.ray, p) as cluster:
            done = _rollout_on_cluster(p, sampling, dtype, cluster, noise, timing)
    else:
        fit = turns.fit_of(p, vreq, hreq)  # refused here, in words, when vLLM alone cannot serve the model
        if fit.in_turn:
            ctx.emit("plan", dtype, fit.words)
            in_turn = {"engines": "in turn", "engines_why": fit.words}
        with ctx.pool.lease_for([vreq, hreq], fit.in_turn, on_wait=ctx.waiter(dtype)) as lease:
            for req in (vreq, hreq):
                say_loading(ctx, dtype, lease, req, p.device)
            t = time.perf_counter()
            lease.host(vreq), lease.host(hreq)
            timing["load_s"] = time.perf_counter() - t
            batches = _batches(p, sampling)
            parts = []
            with ctx.pool.device_turn(ctx.waiter(dtype), what="rollout"):
                if fit.in_turn:  # vLLM's work on every batch, then HF's: two turns, not two a batch
                    sample = turns.sample_for(
                        [len(x) + sampling.max_tokens - 1 for x in p.seqs for _ in range(sampling.samples)],
                        p.model.vocab_size,
                        p.seqs,
                    )
                    parts = _in_turn(p, sampling, dtype, lease, batches, timing, sample)
                    if sample:
                        in_turn["kl_sample"] = turns.sample_where(sample)
                else:
                    for b, (lo, hi) in enumerate(batches):
                        if len(batches) > 1:
                            ctx.emit("sample", dtype, f"batch {b + 1} of {len(batches)}: prompts {lo + 1} to {hi}")
                        parts.append(_sample_and_score(p, sampling, dtype, lease, lo, hi, timing))
                done = Sampled.join(parts)
                floors = _noise_floors(p, dtype, lease, vreq, hreq, done.first(noise), sampling.to_dict(), noise, timing)
            done = dataclasses.replace(done, floors=floors)
            if len(batches) > 1:
                timing["batches"] = len(batches)
            if fit.in_turn:
                timing["turns"] = lease.switches + 1
    timing["total_s"] = time.perf_counter() - t_all
    recs, per_sample = done.samples, done.per_sample
    routing = done.routing()
    summary = {
        pair: mismatch_metrics([r.logprob[a] for r in recs], [r.logprob[b] for r in recs]) for pair, (a, b, _) in PAIRS.items()
    }
    summary["prefill_vs_hf"].update(exact_stats(recs, sampled=sample is not None))
    summary = with_bands(
        summary, done.floors or {}, dtype, ((r.logprob[a], r.logprob[b]) for r in recs for a, b, _ in [PAIRS[MAIN_PAIR]])
    )
    processes = sampling.processes(p.model.vocab_size)
    kl_why = done.kl_why
    vllm_engine = {
        **(done.engines.get("vllm") or {}),
        "kl_full": (
            f"not computed: {kl_why}"
            if kl_why is not None
            else "exact, every completion token of prefill_vs_hf"
            if sample is None
            else turns.sample_words(
                int(sum(np.isfinite(r.exact["kl_full"]).sum() for r in recs)),
                sum(len(r.completion_token_ids) for r in recs),
                sample,
                "completion tokens of prefill_vs_hf",
                summary["prefill_vs_hf"].get("kl_full_mean"),
                summary["prefill_vs_hf"].get("kl_full_mean_err"),
            )
        ),
        **in_turn,
    }
    meta = RolloutMeta(
        rollout_id=rid,
        **p.provenance(dtype, done.engines.get("hf") or {}, vllm_engine),
        bos=p.spec.bos,
        settings={**p.spec.settings.to_dict(), "max_model_len": vreq.max_model_len},
        sampling=sampling.to_dict(),
        prompts=tuple(p.spec.texts),
        processed=(
            "vLLM's own pass in processed_logprobs mode, same seeds, same tokens"
            if processes
            else "equal to raw: at temperature 1 with no top-k/top-p, processing changes nothing (checked in the tests)"
        ),
        timing={k: round(x, 3) for k, x in timing.items()},
        summary=summary,
        floors=done.floors,
        samples=tuple({**r.info(), **({"routing": per_sample[k]} if per_sample else {})} for k, r in enumerate(recs)),
        routing=routing,
    )
    return Rollout(meta=dataclasses.replace(meta, verdict=rollout_verdict(meta).to_dict()), samples=tuple(recs))


@dataclass(frozen=True)
class Sampled:
    """What a rollout's engines gave for some of its prompts (all of them, or one batch on a Ray
    worker): the samples as records, and what the floors and the routing need of them."""

    samples: tuple[Sample, ...]
    decode_batch: int  # completions vLLM sampled together: the batch the decode floor compares against
    kl_why: str | None
    engines: dict[str, Any]
    hf_first: tuple[np.ndarray, ...] = ()  # HF's logprobs of the first samples (the floors rescore those)
    routes: tuple[Any, ...] = ()  # an MoE model: (why not measured | None, per-sample comparisons, replay gaps' inputs)
    floors: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def per_sample(self) -> list[dict[str, Any]]:
        return list(self.routes[1]) if self.routes and self.routes[0] is None else []

    def routing(self) -> dict[str, Any]:
        """The routing record over every sample (`_routing_record`)."""
        return _routing_record(self.routes, self.samples)

    def first(self, k: int) -> dict[str, Any]:
        """The first k samples as the floors read them."""
        s = self.samples[: min(k, len(self.samples))]
        return {
            "prompts": [list(x.prompt_token_ids) for x in s],
            "seeds": [x.seed for x in s],
            "completions": [list(x.completion_token_ids) for x in s],
            "raw": [x.logprob["decode_raw"] for x in s],
            "hf": [x.logprob["hf"] for x in s],
            "batch": self.decode_batch,
        }

    @staticmethod
    def join(parts: list[Sampled]) -> Sampled:
        """Batches' results in prompt order, as one."""
        routes: tuple[Any, ...] = ()
        if parts and all(x.routes for x in parts):
            why = next((x.routes[0] for x in parts if x.routes[0] is not None), None)
            routes = (why, [r for x in parts for r in x.routes[1]], [g for x in parts for g in x.routes[2]], parts[0].routes[3])
        whys = sorted({x.kl_why for x in parts if x.kl_why})
        return Sampled(
            samples=tuple(s for x in parts for s in x.samples),
            decode_batch=parts[0].decode_batch,
            kl_why="; ".join(whys) if whys else None,
            engines=parts[0].engines,
            routes=routes,
        )


def _in_turn(
    p: Prepared,
    sampling: Sampling,
    dtype: str,
    lease: Any,
    batches: list[tuple[int, int]],
    timing: dict[str, float],
    sample: tuple[int, int] | None,
) -> list[Sampled]:
    """Engines in turn: vLLM samples and prefills every batch (its rows wait in the spool's files),
    then HF finishes every batch. The batches and seeds are the side-by-side run's, so are the values."""
    staged: list[dict[str, Any]] = []
    try:
        for b, (lo, hi) in enumerate(batches):
            p.ctx.emit("sample", dtype, f"vLLM's turn, batch {b + 1} of {len(batches)}: prompts {lo + 1} to {hi}")
            staged.append(_vllm_part(p, sampling, dtype, lease, lo, hi, timing, sample))
        out = []
        for b, got in enumerate(staged):
            p.ctx.emit("score", dtype, f"HF's turn, batch {b + 1} of {len(batches)}")
            out.append(_hf_part(p, sampling, dtype, lease, got, timing))
        return out
    finally:
        for got in staged:
            got["ex"].close()


def _sample_and_score(
    p: Prepared, sampling: Sampling, dtype: str, lease: Any, lo: int, hi: int, timing: dict[str, float]
) -> Sampled:
    """Prompts [lo, hi): vLLM samples every (prompt, seed) request in one generate call, vLLM
    prefill and HF rescore the ids, an MoE model's decode routes are compared and replayed; the
    samples as records."""
    return _hf_part(p, sampling, dtype, lease, _vllm_part(p, sampling, dtype, lease, lo, hi, timing), timing)


def _vllm_part(
    p: Prepared,
    sampling: Sampling,
    dtype: str,
    lease: Any,
    lo: int,
    hi: int,
    timing: dict[str, float],
    sample: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """vLLM's work on prompts [lo, hi): the samples in one generate call, then its prefill of the
    same ids, which leaves its full rows for the exact KL (every row, or `sample`'s: engines in turn
    past the spool's bound). What `_hf_part` needs to finish the batch."""
    ctx = p.ctx
    vreq, _ = _engines(p, dtype, sampling)
    vllm = lease.host(vreq)
    n = sampling.samples
    seeds = sampling.seeds(len(p.seqs))[lo * n : hi * n]
    req_prompts = [p.seqs[lo + k // n] for k in range(len(seeds))]
    processes = sampling.processes(p.model.vocab_size)
    modes = (RAW, PROCESSED) if processes else (RAW,)
    sdict = sampling.to_dict()
    ctx.emit(
        "sample",
        dtype,
        f"vLLM samples {len(seeds)} completion(s) of up to {sampling.max_tokens} tokens, "
        f"all submitted together{' (raw, then processed with the same seeds)' if processes else ''}",
    )
    t = time.perf_counter()
    samples = lease.call(vreq, lambda: vllm.sample(req_prompts, seeds, sdict, modes))
    timing["sample_s"] = timing.get("sample_s", 0.0) + time.perf_counter() - t
    for k, s in enumerate(samples):
        if processes and s["tokens_by_mode"][PROCESSED] != s["tokens_by_mode"][RAW]:
            raise UserError(
                f"sample {lo * n + k + 1} (seed {seeds[k]}) came out different in vLLM's second pass with the same seed: "
                "its sampling is not reproducible here, so raw and processed logprobs cannot be paired"
            )
    full = [list(pr) + s["completion_ids"] for pr, s in zip(req_prompts, samples)]
    starts = [len(pr) for pr in req_prompts]
    ctx.emit("score", dtype, f"vLLM prefill rescores {sum(map(len, full))} tokens")
    # vLLM prefill leaves its full logprobs for the exact KL of prefill_vs_hf (logprob_parity.engines.fullvocab)
    ex = fullvocab.Exchange(
        sum(len(f) - 1 for f in full),
        p.model.vocab_size,
        p.device,
        getattr(lease, "transport", None),
        sample=fullvocab.kept_of(full, sample),
    )
    try:
        t = time.perf_counter()
        prefill = lease.call(vreq, lambda: vllm.score(full, 1, None, None, "right", ex.vllm_target))
        ex.after_vllm(vllm)
        timing["prefill_s"] = timing.get("prefill_s", 0.0) + time.perf_counter() - t
    except BaseException:
        ex.close(vllm)
        raise
    return {
        "lo": lo,
        "samples": samples,
        "seeds": seeds,
        "req_prompts": req_prompts,
        "full": full,
        "starts": starts,
        "prefill": prefill,
        "ex": ex,
        "processes": processes,
    }


def _hf_part(p: Prepared, sampling: Sampling, dtype: str, lease: Any, got: dict[str, Any], timing: dict[str, float]) -> Sampled:
    """HF's work on a batch vLLM has done (`_vllm_part`): its teacher-forced rescore with the exact
    KL against vLLM's rows, an MoE model's routes; the samples as records. The rows are freed here."""
    ctx = p.ctx
    vreq, hreq = _engines(p, dtype, sampling)
    vllm, hf = lease.host(vreq), lease.host(hreq)
    lo, samples, seeds, req_prompts = got["lo"], got["samples"], got["seeds"], got["req_prompts"]
    full, starts, prefill, ex, processes = got["full"], got["starts"], got["prefill"], got["ex"], got["processes"]
    n = sampling.samples
    try:
        ctx.emit("score", dtype, "HF rescores the same ids, teacher-forced (the trainer's side)")
        t = time.perf_counter()
        hf_scores = lease.call(
            hreq,
            lambda: hf.rollout_score(full, starts, sampling.temperature, sampling.top_k, sampling.top_p, None, ex.hf_source),
        )
        timing["hf_s"] = timing.get("hf_s", 0.0) + time.perf_counter() - t
    finally:
        ex.close(vllm)
    t = time.perf_counter()
    routes = _decode_routes(ctx, dtype, lease, hreq, hf, samples, full, starts, hf_scores)
    if routes[0] is None:
        timing["routing_s"] = timing.get("routing_s", 0.0) + time.perf_counter() - t
    tokenizer = p.tokenizer
    recs = []
    for k, (s, pre, h) in enumerate(zip(samples, prefill, hf_scores)):
        ids = s["completion_ids"]
        n0 = starts[k]
        pre_ids = [int(x) for x in pre.token_ids[n0:]]
        if pre_ids != ids or len(h["logprob"]) != len(ids):
            raise AssertionError(f"sample {lo * n + k + 1}: the three scorings did not score the same completion ids")
        raw = np.asarray(s["logprobs"][RAW], dtype=np.float64)
        lp = {
            "decode_raw": raw,
            "decode_processed": np.asarray(s["logprobs"][PROCESSED], dtype=np.float64) if processes else raw.copy(),
            "prefill": np.asarray(pre.logprob[n0:], dtype=np.float64),
            "hf": np.asarray(h["logprob"], dtype=np.float64),
            "hf_tempered": np.asarray(h["tempered"], dtype=np.float64),
            "log_kept_mass": np.asarray(h["log_kept_mass"], dtype=np.float64),
        }
        pieces = decode_tail_pieces(tokenizer, list(req_prompts[k]) + ids, n0)
        exact = {
            "kl_full": np.asarray(h.get("kl_full", np.full(len(ids), np.nan)), dtype=np.float64),
            "same_top": (pre.topk_ids[n0:, 0] == h["top_id"]).astype(np.float64),
        }
        recs.append(
            Sample(
                prompt_index=lo + k // n,
                seed=seeds[k],
                prompt_token_ids=tuple(req_prompts[k]),
                completion_token_ids=tuple(ids),
                pieces=tuple(pieces),
                finish_reason=s.get("finish_reason"),
                logprob=lp,
                exact=exact,
            )
        )
    return Sampled(
        samples=tuple(recs),
        decode_batch=len(samples),
        kl_why=ex.why,
        engines={"hf": hf.info or {}, "vllm": vllm.info or {}},
        routes=routes,
    )


def _decode_routes(
    ctx: Any,
    dtype: str,
    lease: Any,
    hreq: LoadRequest,
    hf: Any,
    samples: list[dict[str, Any]],
    full: list[list[int]],
    starts: list[int],
    hf_scores: list[dict[str, Any]],
) -> tuple[Any, ...]:
    """An MoE model: the experts vLLM's decode picked against the trainer's (HF teacher-forced on the
    same ids), at each completion token's decode step (the forward that gave its logprob), and
    routing replay: HF rescored with the decode's experts forced (R3's rule). (None, per-sample
    comparisons, each sample's (decode, HF, replayed HF) logprobs, (layers, top_k, device)), or
    (why not, [], [], None) for a dense model or where vLLM gave none."""
    routes = [s.get("routes") for s in samples]
    whys = [s["routes_why"] for s in samples if s.get("routes_why")]
    if whys or any(r is None for r in routes):
        return (whys[0] if whys else NOT_MOE, [], [], None)
    ctx.emit("routing", dtype, "the experts each MoE layer picked at each decode step, against HF's on the same ids")
    h = lease.call(hreq, lambda: hf.routes(full))
    if isinstance(h, str):
        return (h, [], [], None)
    per = [compare_routes(r[n0 - 1 : len(f) - 1], hr[n0 - 1 : len(f) - 1]) for r, hr, n0, f in zip(routes, h, starts, full)]
    ctx.emit("routing", dtype, "HF again with the decode's experts forced on every MoE layer (routing replay)")
    # the decode's experts at every forwarded token; the last token (never forwarded) keeps HF's own
    forced = [np.concatenate([r, hr[len(r) :]]) for r, hr in zip(routes, h)]
    replayed = lease.call(hreq, lambda: hf.replay_score(full, forced))
    gaps = [
        (
            np.asarray(s["logprobs"][RAW], dtype=np.float64),
            np.asarray(x["logprob"], dtype=np.float64),
            np.asarray(rep, dtype=np.float64)[n0:],
        )
        for s, x, rep, n0 in zip(samples, hf_scores, replayed, starts)
    ]
    return (None, per, gaps, (per[0]["layers"] if per else 0, int(h[0].shape[-1]) if h else 0, hreq.device))


def _routing_record(routes: tuple[Any, ...], samples: Any) -> dict[str, Any]:
    """The rollout's routing record from `_decode_routes` over every sample: the flips, and the
    decode-vs-HF gap before and after replay."""
    if not routes or routes[0] is not None:
        return {"measured": False, "why": routes[0] if routes else NOT_MOE}
    _, per, gaps, (layers, top_k, device) = routes
    before = floors_def.gap([g[0] for g in gaps], [g[1] for g in gaps])
    after = floors_def.gap([g[0] for g in gaps], [g[2] for g in gaps])
    share = None if not before["mean"] or after["mean"] is None else 1.0 - after["mean"] / before["mean"]
    return {
        "measured": True,
        "samples": len(per),
        "tokens": int(sum(len(x["flipped"]) for x in per)),
        "layers": layers,
        "top_k": top_k,
        "positions": "each completion token's decode step: the forward that gave its logprob",
        "vllm_from": (  # as the vLLM backend reads them (VLLMBackend._decode_routes)
            "a capture on each MoE router of the engine, cut request by request in the rollout's own batched generate"
            if device == "cpu"
            else VLLM_OWN + ", from the rollout's own generate"
        ),
        "hf_from": "each MoE layer's router logits, top-k, on the prompt and completion teacher-forced",
        **routing_summary(per),
        "replay": {
            "mean_abs_delta_before": before["mean"],
            "mean_abs_delta_after": after["mean"],
            "max_abs_delta_before": before["max"],
            "max_abs_delta_after": after["max"],
            "share_removed": share,
            "what": "HF rescored with the decode's expert ids forced, weights from HF's router logits (R3, arXiv 2510.11370)",
        },
    }


def _noise_floors(
    p: Prepared,
    dtype: str,
    lease: Any,
    vreq: LoadRequest,
    hreq: LoadRequest,
    first: dict[str, Any],
    sdict: dict[str, Any],
    noise: int,
    timing: dict[str, float],
) -> dict[str, dict[str, Any]]:
    """How much each side moves when only the batch or the way of scoring changes, on the first
    samples (`Sampled.first`)."""
    ctx = p.ctx
    floors: dict[str, dict[str, Any]] = {}
    k = min(noise, len(first["seeds"]))
    if k == 0:
        return floors
    vllm, hf = lease.host(vreq), lease.host(hreq)
    prompts, seeds, completions = first["prompts"], first["seeds"], first["completions"]
    full = [pr + c for pr, c in zip(prompts, completions)]
    starts = [len(pr) for pr in prompts]
    t = time.perf_counter()
    n_dec = min(sdict["max_tokens"], NOISE_DECODE_TOKENS)
    short = {**sdict, "max_tokens": n_dec}
    ctx.emit(
        "noise",
        dtype,
        f"vLLM decodes {k} seeded sample(s) again, each alone (batch of 1 instead of {first['batch']}), their first {n_dec} tokens",
    )
    alone_raw, batch_raw, same = [], [], 0
    for i in range(k):
        alone = lease.call(vreq, lambda i=i: vllm.sample([prompts[i]], [seeds[i]], short, (RAW,)))[0]
        if alone["completion_ids"] == completions[i][:n_dec]:
            same += 1
            alone_raw.append(alone["logprobs"][RAW])
            batch_raw.append(list(first["raw"][i][: len(alone["completion_ids"])]))
    floors["decode_batch"] = {
        **floor_stats(alone_raw, batch_raw),
        "same_tokens": same,
        "of": k,
        "side": "vllm",
        "what": f"vLLM decode: each sample alone vs in the batch of {first['batch']} (the first {n_dec} tokens)",
    }
    ctx.emit(
        "noise",
        dtype,
        f"HF's floor on {k} sample(s): micro-batch, padding side, packed, chunked through its KV cache; and token by token",
    )
    one = first["hf"]
    # the floor's definition (logprob_parity.analysis.floors), on the completions: position-aligned values
    base = [np.concatenate([np.full(s, np.nan), o]) for o, s in zip(one[:k], starts[:k])]
    others = floors_def.other_prompts(p.tokenizer, p.spec.bos, p.max_model_len, p.device)
    variations, skipped = lease.call(
        hreq,
        lambda: floors_def.hf_variations(
            hf, full[:k], base, others, p.device, starts=starts[:k], hf_batch_size=hreq.settings.hf_batch_size
        ),
    )
    floors.update(floors_def.floor_rows(variations, skipped))
    inc = lease.call(hreq, lambda: hf.rollout_score(full[:k], starts[:k], chunk=1, tail=INCREMENTAL_TOKENS))
    floors["hf_incremental"] = {
        **floor_stats([c["logprob"] for c in inc], [o[int(c["first"]) - s :] for c, o, s in zip(inc, one[:k], starts[:k])]),
        "side": "hf",
        "tokens": INCREMENTAL_TOKENS,
        "what": f"HF: one token a forward through the KV cache (a per-prefix loop) vs one pass, "
        f"the last {INCREMENTAL_TOKENS} tokens of each sample",
    }
    timing["noise_s"] = time.perf_counter() - t
    return floors


def _batches(p: Prepared, sampling: Sampling) -> list[tuple[int, int]]:
    """Consecutive prompts [lo, hi) a generate call, every sample of a prompt in its prompt's batch,
    cut as a comparison's batches are (logprob_parity.analysis.compare.plan_batches: positions and the exact
    KL's rows). The same plan here and on a Ray cluster, so both sample the same batches: a decode's
    numbers can depend on what else is in its batch (the decode floor measures how much)."""
    from logprob_parity.analysis.compare import plan_batches

    n = sampling.samples
    return plan_batches([(len(x) + sampling.max_tokens) * n for x in p.seqs], p.model.vocab_size, p.device)


def _rollout_on_cluster(
    p: Prepared, sampling: Sampling, dtype: str, cluster: Any, noise: int, timing: dict[str, float]
) -> Sampled:
    """The prompts in batches on a Ray cluster's workers (each samples and rescores its batch on its
    own warm engines), then the floors on one worker, on the first batch's first samples."""
    from logprob_parity.analysis.cluster import Job

    n = sampling.samples
    batches = _batches(p, sampling)
    jobs = [Job(b, (dtype, sampling, lo, hi), (hi - lo) * n) for b, (lo, hi) in enumerate(batches)]
    got: dict[int, Sampled] = {}

    def keep(job: Job, result: tuple[Sampled, dict[str, float]], worker: int) -> None:
        got[job.key] = result[0]
        for k, x in result[1].items():
            timing[k] = timing.get(k, 0.0) + x

    p.ctx.emit("sample", dtype, f"{len(p.seqs)} prompt(s) x {n} sample(s) in {len(batches)} batch(es) on {cluster.words()}")
    cluster.map(f"{__name__}:sample_on_worker", jobs, keep, dtype, unit="samples", batches=len(batches))
    done = Sampled.join([got[b] for b in range(len(batches))])
    floors, t_noise = cluster.call(
        f"{__name__}:floors_on_worker", dtype, sampling, done.first(noise), noise, dtype=dtype, what="the noise floors"
    )
    timing["noise_s"] = t_noise
    timing.update(ray_workers=len(cluster.workers), ray_workers_alive=len(cluster.alive), batches=len(batches))
    return dataclasses.replace(done, floors=floors)


def sample_on_worker(p: Prepared, dtype: str, sampling: Sampling, lo: int, hi: int) -> tuple[Sampled, dict[str, float]]:
    """One batch of prompts on a Ray worker's warm engines (`_sample_and_score`, as here)."""
    timing: dict[str, float] = {}
    with p.ctx.pool.lease(list(_engines(p, dtype, sampling))) as lease:
        return _sample_and_score(p, sampling, dtype, lease, lo, hi, timing), timing


def floors_on_worker(
    p: Prepared, dtype: str, sampling: Sampling, first: dict[str, Any], noise: int
) -> tuple[dict[str, Any], float]:
    timing: dict[str, float] = {}
    vreq, hreq = _engines(p, dtype, sampling)
    with p.ctx.pool.lease([vreq, hreq]) as lease:
        floors = _noise_floors(p, dtype, lease, vreq, hreq, first, sampling.to_dict(), noise, timing)
    return floors, timing.get("noise_s", 0.0)


__all__ = ["COLUMNS", "MAIN_PAIR", "PAIRS", "Sampling", "hf_floor", "rollout"]
