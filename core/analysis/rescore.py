"""Rescore rollouts someone else sampled: their logged logprobs against vLLM prefill and HF.

An RL run already has its rollouts: prompt and completion ids with the logprobs its rollout engine
returned (core.inputs.rollout_logs). Here they take the decode row (`decode_raw`, and
`decode_processed` too, the logger's values being whichever its engine returned), vLLM prefill and HF
(the trainer's side, at each record's temperature, with the mass its top-k/top-p keep) rescore the same
ids, in batches of sequences, and the result is a Rollout like `rollout`'s: the same pairs, RL
mismatch metrics, floors (HF's own; there is no decoding here to re-run), verdict, store entry,
page, report and `--json`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from typing import Any

import numpy as np

from core.analysis.compare import plan_batches
from core.analysis.request import Context, model_max_len, prepare
from core.analysis.rollout import CHUNK, INCREMENTAL_TOKENS, MICRO_BATCH, with_trainer_defaults
from core.analysis.verdict import rollout_verdict
from core.engines import fullvocab
from core.engines.host import start_words
from core.engines.records import LoadRequest
from core.env import device_name, versions
from core.errors import UserError
from core.inputs.rollout_logs import LoggedSet, read_logged
from core.inputs.spec import RunSpec, content_hash
from core.inputs.tokens import decode_tail_pieces
from core.results.offpolicy import floor_stats, mismatch_metrics
from core.results.records import RunEnv
from core.results.rollout import PAIRS, ROLLOUT_SCHEMA, Rollout, RolloutMeta, Sample, exact_stats

NOISE_SEQUENCES = 2  # logged sequences HF rescores again in micro-batches, in chunks and token by token
PROCESSED_WORDS = ("the logged values: the rollout engine's own logprobs, raw or processed as its logger wrote them "
                   "(vLLM's default is raw)")


def rescore(data: bytes, name: str, spec: RunSpec, ctx: Context | None = None, mapping: dict[str, str] | None = None,
            use_cache: bool = True, noise_sequences: int = NOISE_SEQUENCES) -> list[Rollout]:
    """One stored Rollout per dtype of `spec` for the logged rollouts in `data` (a file's bytes,
    `name` its file name). Every record is checked before any engine starts; stored ones come back
    without an engine. `spec.texts` is not used (the prompts come from the file)."""
    ctx = ctx or Context.of()
    spec = with_trainer_defaults(spec)
    p = prepare(dataclasses.replace(spec, texts=(f"logged rollouts from {name}",)), ctx)
    ctx.emit("tokenize", None, f"reading and checking the records of {name}")
    logged = read_logged(data, name, mapping or {}, p.tokenizer, p.spec.bos, p.model.vocab_size)
    longest = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in logged.sequences)
    if p.model.max_positions is not None and longest > p.model.max_positions:
        raise UserError(f"a logged sequence is {longest} tokens but {p.model.name} has {p.model.max_positions} positions")
    out = []
    for dtype in p.spec.dtypes:
        rid = content_hash({"schema": ROLLOUT_SCHEMA, "kind": "rescore", "model": p.model.identity, "dtype": dtype,
                            "settings": p.spec.settings.run_id_part(), "bos": p.spec.bos, "logged": logged.digest,
                            "noise": noise_sequences, "versions": {k: versions()[k] for k in ("torch", "transformers", "vllm")},
                            "device": device_name(p.device)})
        if use_cache and ctx.store.has_rollout(rid):
            ctx.emit("cache", dtype, f"rescore {rid} from the store, no engine started")
            out.append(ctx.store.load_rollout(rid))
            continue
        r = _rescore_dtype(p, logged, dtype, rid, model_max_len(longest, p.model.max_positions), noise_sequences)
        ctx.store.save_rollout(r)
        ctx.emit("store", dtype, f"rescore {rid} saved")
        out.append(r)
    return out


def _groups(logged: LoggedSet) -> list[list[int]]:
    """Sequence indices by how they were sampled (temperature, top-p, top-k): HF rescores a group at once."""
    by: dict[tuple[float, float, int], list[int]] = {}
    for i, s in enumerate(logged.sequences):
        by.setdefault((s.temperature, s.top_p, s.top_k), []).append(i)
    return list(by.values())


def _rescore_dtype(p: Any, logged: LoggedSet, dtype: str, rid: str, mml: int, noise: int) -> Rollout:
    ctx = p.ctx
    t_all = time.perf_counter()
    vreq = LoadRequest("vllm", p.model.path, dtype, p.device, p.spec.settings, mml)
    hreq = LoadRequest("hf", p.model.path, dtype, p.device, p.spec.settings, mml)
    seqs = logged.sequences
    full = [list(s.prompt_token_ids) + list(s.completion_token_ids) for s in seqs]
    starts = [len(s.prompt_token_ids) for s in seqs]
    prefill: list[Any] = [None] * len(seqs)
    hf_scores: list[Any] = [None] * len(seqs)
    timing = {"prefill_s": 0.0, "hf_s": 0.0}
    kl_why: set[str] = set()
    total, done = logged.n_tokens, 0
    with ctx.pool.lease([vreq, hreq], on_wait=ctx.waiter(dtype)) as lease:
        for req in (vreq, hreq):
            ctx.emit("load", dtype, f"{req.backend}: warm engine" if lease.warm(req) else
                     f"{req.backend}: starting the engine ({start_words(req.backend, p.device)}; it stays warm for the next run)")
        vllm, hf = lease.host(vreq), lease.host(hreq)
        groups = _groups(logged)
        for g in groups:
            for lo, hi in plan_batches([len(full[i]) for i in g], p.model.vocab_size, p.device):
                idx = g[lo:hi]
                batch = [full[i] for i in idx]
                s0 = seqs[idx[0]]
                with ctx.pool.device_turn(ctx.waiter(dtype), what="rescoring"):
                    ex = fullvocab.Exchange(sum(len(f) - 1 for f in batch), p.model.vocab_size, p.device)
                    try:
                        t = time.perf_counter()
                        pre = lease.call(vreq, lambda: vllm.score(batch, 1, None, None, "right", ex.vllm_target))
                        ex.after_vllm(vllm)
                        timing["prefill_s"] += time.perf_counter() - t
                        t = time.perf_counter()
                        got = lease.call(hreq, lambda: hf.rollout_score(batch, [starts[i] for i in idx], s0.temperature, s0.top_k,
                                                                         s0.top_p, None, ex.hf_source))
                        timing["hf_s"] += time.perf_counter() - t
                    finally:
                        ex.close(vllm)
                if ex.why:
                    kl_why.add(ex.why)
                for i, a, b in zip(idx, pre, got):
                    prefill[i], hf_scores[i] = a, b
                done += sum(len(seqs[i].completion_token_ids) for i in idx)
                ctx.on_progress(dtype, done, total)
                ctx.emit("batch", dtype, f"{done:,} of {total:,} logged tokens rescored")
        floors = _floors(ctx, dtype, lease, hreq, hf, full, starts, hf_scores, noise, timing)
    timing["total_s"] = time.perf_counter() - t_all
    recs = []
    for k, (s, pre, h) in enumerate(zip(seqs, prefill, hf_scores)):
        n0 = starts[k]
        if [int(x) for x in pre.token_ids[n0:]] != list(s.completion_token_ids) or len(h["logprob"]) != len(s.completion_token_ids):
            raise AssertionError(f"record {s.record}: the scorings did not score the logged completion ids")
        logged_lp = np.asarray(s.logprobs, dtype=np.float64)
        lp = {"decode_raw": logged_lp, "decode_processed": logged_lp.copy(), "prefill": np.asarray(pre.logprob[n0:], dtype=np.float64),
              "hf": np.asarray(h["logprob"], dtype=np.float64), "hf_tempered": np.asarray(h["tempered"], dtype=np.float64),
              "log_kept_mass": np.asarray(h["log_kept_mass"], dtype=np.float64)}
        exact = {"kl_full": np.asarray(h.get("kl_full", np.full(len(logged_lp), np.nan)), dtype=np.float64),
                 "same_top": (pre.topk_ids[n0:, 0] == h["top_id"]).astype(np.float64)}
        recs.append(Sample(prompt_index=k, seed=-1, prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                           pieces=tuple(decode_tail_pieces(p.tokenizer, full[k], n0)),
                           finish_reason=f"logged record {s.record}" + (f", id {s.id}" if s.id else "") +
                                         (f", step {s.step}" if s.step is not None else ""),
                           logprob=lp, exact=exact))
    summary = {pair: mismatch_metrics([r.logprob[a] for r in recs], [r.logprob[b] for r in recs]) for pair, (a, b, _) in PAIRS.items()}
    summary["prefill_vs_hf"].update(exact_stats(recs))
    temps = sorted({s.temperature for s in seqs})
    top_ps = sorted({s.top_p for s in seqs})
    top_ks = sorted({s.top_k for s in seqs})
    sampling = {"source": "logged", "file": logged.source, "records": len(seqs), "samples": 1, "temperature": temps[0],
                "top_p": top_ps[0], "top_k": top_ks[0], "max_tokens": max(len(s.completion_token_ids) for s in seqs),
                "seed": None, "varies": len(temps) * len(top_ps) * len(top_ks) > 1, "digest": logged.digest}
    now = dt.datetime.now(dt.timezone.utc)
    v = versions()
    meta = RolloutMeta(
        rollout_id=rid, created=now.isoformat(timespec="seconds"), created_ts=now.timestamp(), model=p.model.name,
        model_path=p.model.path, revision=p.model.revision, model_identity=p.model.identity, dtype=dtype, device=p.device,
        bos=p.spec.bos, settings={**p.spec.settings.to_dict(), "max_model_len": mml}, sampling=sampling,
        prompts=tuple(p.tokenizer.decode(list(s.prompt_token_ids)) for s in seqs), processed=PROCESSED_WORDS,
        env=RunEnv(device=device_name(p.device), torch=v["torch"], transformers=v["transformers"], vllm=v["vllm"],
                   vllm_dist=v["vllm_dist"], hf_engine=hf.info or {},
                   vllm_engine={**(vllm.info or {}), "kl_full": "exact, every completion token of prefill_vs_hf" if not kl_why
                                else "not computed: " + "; ".join(sorted(kl_why))}),
        timing={k: round(x, 3) for k, x in timing.items()}, summary=summary, floors=floors, samples=tuple(r.info() for r in recs))
    return Rollout(meta=dataclasses.replace(meta, verdict=rollout_verdict(meta).to_dict()), samples=tuple(recs))


def _floors(ctx: Any, dtype: str, lease: Any, hreq: LoadRequest, hf: Any, full: list[list[int]], starts: list[int],
            hf_scores: list[Any], noise: int, timing: dict[str, float]) -> dict[str, dict[str, Any]]:
    """HF's own noise on the first logged sequences: padded micro-batches, chunks through the KV cache,
    one token a forward (the trainer's ways of scoring). No decode floor: nothing is decoded here."""
    k = min(noise, len(full))
    if k == 0:
        return {}
    t = time.perf_counter()
    ctx.emit("noise", dtype, f"HF scores {k} logged sequence(s) in padded micro-batches, in chunks of {CHUNK} tokens, and token by token")
    one = [h["logprob"] for h in hf_scores]
    with ctx.pool.device_turn(ctx.waiter(dtype), what="the noise floor"):
        mb = lease.call(hreq, lambda: hf.score(full[:MICRO_BATCH], 1, None, MICRO_BATCH))
        chunk = max(2, min(CHUNK, min(len(f) for f in full[:k]) // 2))
        chunked = lease.call(hreq, lambda: hf.rollout_score(full[:k], starts[:k], chunk=chunk))
        inc = lease.call(hreq, lambda: hf.rollout_score(full[:k], starts[:k], chunk=1, tail=INCREMENTAL_TOKENS))
    floors = {
        "hf_micro_batch": {**floor_stats([m.logprob[s:] for m, s in zip(mb, starts)], one[: len(mb)]), "side": "hf",
                           "what": f"HF: padded micro-batches of {MICRO_BATCH} vs one sequence a pass"},
        "hf_chunked": {**floor_stats([c["logprob"] for c in chunked], one[:k]), "side": "hf", "chunk": chunk,
                       "what": f"HF: {chunk} tokens a forward through the KV cache vs one pass"},
        "hf_incremental": {**floor_stats([c["logprob"] for c in inc], [o[int(c["first"]) - s:] for c, o, s in zip(inc, one[:k], starts[:k])]),
                           "side": "hf", "tokens": INCREMENTAL_TOKENS,
                           "what": f"HF: one token a forward through the KV cache vs one pass, the last {INCREMENTAL_TOKENS} tokens"},
    }
    timing["noise_s"] = time.perf_counter() - t
    return floors
