"""Rescore rollouts someone else sampled: their logged logprobs against vLLM prefill and HF.

An RL run already has its rollouts: prompt and completion ids with the logprobs its rollout engine
returned (core.inputs.rollout_logs). Here they take the decode row (`decode_raw`, and
`decode_processed` too, the logger's values being whichever its engine returned), vLLM prefill and HF
(the trainer's side, at each record's temperature, with the mass its top-k/top-p keep) rescore the same
ids, in batches of sequences, and the result is a Rollout like `rollout`'s: the same pairs, RL
mismatch metrics, floors (HF's own; there is no decoding here to re-run), verdict, store entry,
page, report and `--json`.

Each finished batch is stored at once (a part, as a comparison's batches are), so a rescore killed
part way and started again on the same file computes only the batches it lacks and says how many
came from the store. The finished record itself is built and stored whole.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from typing import Any

import numpy as np

from core.analysis.compare import plan_batches, words_left
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
        if not use_cache:
            ctx.store.drop_partial(rid)
        r = _rescore_dtype(p, logged, dtype, rid, model_max_len(longest, p.model.max_positions), noise_sequences)
        ctx.store.save_rollout(r)
        ctx.store.drop_partial(rid)
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
    scored: list[dict[str, np.ndarray] | None] = [None] * len(seqs)  # per sequence: _COLUMNS over its completion
    timing = {"prefill_s": 0.0, "hf_s": 0.0}
    kl_why: set[str] = set()
    total, done, computed, reused, t_compute = logged.n_tokens, 0, 0, 0, 0.0
    store = ctx.store
    batches = [g[lo:hi] for g in _groups(logged) for lo, hi in plan_batches([len(full[i]) for i in g], p.model.vocab_size, p.device)]
    with ctx.pool.lease([vreq, hreq], on_wait=ctx.waiter(dtype)) as lease:
        for req in (vreq, hreq):
            ctx.emit("load", dtype, f"{req.backend}: warm engine" if lease.warm(req) else
                     f"{req.backend}: starting the engine ({start_words(req.backend, p.device)}; it stays warm for the next run)")
        vllm, hf = lease.host(vreq), lease.host(hreq)
        for b, idx in enumerate(batches):
            batch = [full[i] for i in idx]
            n_tok = sum(len(seqs[i].completion_token_ids) for i in idx)
            digest = content_hash(batch, 16)
            old = store.part_info(rid, b)
            if old is not None and (old.get("idx"), old.get("ids")) == (idx, digest):
                _unpack(store.part_table(rid, b), idx, scored)
                if old.get("kl_why"):
                    kl_why.add(old["kl_why"])
                done += n_tok
                reused += 1
                continue
            t_b = time.perf_counter()
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
            table = _pack(seqs, idx, starts, pre, got)
            store.save_part(rid, b, table, {"idx": idx, "ids": digest, "kl_why": ex.why})
            _unpack(table, idx, scored)
            done += n_tok
            computed += n_tok
            t_compute += time.perf_counter() - t_b
            ctx.on_progress(dtype, done, total)
            rate = computed / t_compute if t_compute else 0.0
            left = f", {words_left((total - done) / rate)}" if rate and done < total else ""
            ctx.emit("batch", dtype, f"batch {b + 1} of {len(batches)} done: {done:,} of {total:,} logged tokens rescored, "
                     f"{rate:,.0f} tokens/s{left}" + (f" ({reused} batch(es) were already in the store)" if reused else ""))
        if reused:
            ctx.emit("cache", dtype, f"{reused} of {len(batches)} batches came from the store (an earlier rescore of this file "
                     f"stopped before it finished); {len(batches) - reused} computed now")
        floors = _floors(ctx, dtype, lease, hreq, hf, full, starts, [{"logprob": x["hf"]} for x in scored], noise, timing)  # type: ignore[index]
    timing.update(batches=len(batches), batches_from_store=reused)
    kl_words = "exact, every completion token of prefill_vs_hf" if not kl_why else "not computed: " + "; ".join(sorted(kl_why))
    engines = {"hf": hf.info or {}, "vllm": {**(vllm.info or {}), "kl_full": kl_words}}
    return assemble(p, logged, scored, dtype, rid, mml, floors, timing, engines, t_all)


def assemble(p: Any, logged: LoggedSet, scored: list[dict[str, np.ndarray]], dtype: str, rid: str, mml: int,
             floors: dict[str, Any], timing: dict[str, Any], engines: dict[str, dict[str, Any]], t_all: float) -> Rollout:
    """The finished rescore as a Rollout: the logged values beside each sequence's scorings (`scored`,
    _COLUMNS per sequence), pieces, metrics, verdict. Apart from the engines, so its cost can be
    measured alone (benchmarks/rescore_profile.py)."""
    seqs = logged.sequences
    recs = []
    for k, (s, x) in enumerate(zip(seqs, scored)):
        logged_lp = np.asarray(s.logprobs, dtype=np.float64)
        lp = {"decode_raw": logged_lp, "decode_processed": logged_lp.copy(), "prefill": x["prefill"], "hf": x["hf"],  # type: ignore[index]
              "hf_tempered": x["hf_tempered"], "log_kept_mass": x["log_kept_mass"]}  # type: ignore[index]
        exact = {"kl_full": x["kl_full"], "same_top": (x["prefill_top"] == x["hf_top"]).astype(np.float64)}  # type: ignore[index]
        recs.append(Sample(prompt_index=k, seed=-1, prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                           pieces=tuple(decode_tail_pieces(p.tokenizer, [*s.prompt_token_ids, *s.completion_token_ids],
                                                           len(s.prompt_token_ids))),
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
                   vllm_dist=v["vllm_dist"], hf_engine=engines["hf"], vllm_engine=engines["vllm"]),
        timing={k: round(x, 3) for k, x in {**timing, "total_s": time.perf_counter() - t_all}.items()}, summary=summary,
        floors=floors, samples=tuple(r.info() for r in recs))
    return Rollout(meta=dataclasses.replace(meta, verdict=rollout_verdict(meta).to_dict()), samples=tuple(recs))


# A finished batch's part (core.results.store.save_part): a row per completion token.
_COLUMNS = ("prefill", "prefill_top", "hf", "hf_tempered", "log_kept_mass", "kl_full", "hf_top")


def _pack(seqs: Any, idx: list[int], starts: list[int], pre: list[Any], got: list[dict[str, np.ndarray]]) -> Any:
    """One batch's scorings as a table (checked: both scored exactly the logged completion ids)."""
    import pyarrow as pa

    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("seq", *_COLUMNS)}
    for i, a, h in zip(idx, pre, got):
        s, n0 = seqs[i], starts[i]
        n = len(s.completion_token_ids)
        if [int(x) for x in a.token_ids[n0:]] != list(s.completion_token_ids) or len(h["logprob"]) != n:
            raise AssertionError(f"record {s.record}: the scorings did not score the logged completion ids")
        cols["seq"].append(np.full(n, i, dtype=np.int64))
        cols["prefill"].append(np.asarray(a.logprob[n0:], dtype=np.float64))
        cols["prefill_top"].append(np.asarray(a.topk_ids[n0:, 0], dtype=np.int64))
        cols["hf"].append(np.asarray(h["logprob"], dtype=np.float64))
        cols["hf_tempered"].append(np.asarray(h["tempered"], dtype=np.float64))
        cols["log_kept_mass"].append(np.asarray(h["log_kept_mass"], dtype=np.float64))
        cols["kl_full"].append(np.asarray(h.get("kl_full", np.full(n, np.nan)), dtype=np.float64))
        cols["hf_top"].append(np.asarray(h["top_id"], dtype=np.int64))
    return pa.table({k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()})


def _unpack(table: Any, idx: list[int], into: list[Any]) -> None:
    """A batch's part back into per-sequence arrays (`into[i]`: _COLUMNS over sequence i's completion)."""
    seq = table.column("seq").to_numpy()
    order = np.argsort(seq, kind="stable")  # one sort, then each sequence's rows are a slice
    cols = {c: table.column(c).to_numpy()[order] for c in _COLUMNS}
    lo = np.searchsorted(seq[order], idx, side="left")
    hi = np.searchsorted(seq[order], idx, side="right")
    for i, a, b in zip(idx, lo, hi):
        into[i] = {c: v[a:b] for c, v in cols.items()}


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
