"""The pipeline: tokenize once, score the same ids with both engines, compare, store."""

from __future__ import annotations

import datetime as dt
import threading
import time
from contextlib import ExitStack
from typing import Any

from core.analysis.metrics import concat, summarize
from core.analysis.request import Context, EventFn, Prepared, prepare
from core.engines import fullvocab
from core.engines.pool import Lease
from core.env import device_name, versions
from core.inputs.models import ResolvedModel
from core.inputs.spec import RunSpec, content_hash
from core.inputs.tokens import TokenizedText
from core.results.records import RunEnv, RunMeta, SequenceInfo
from core.results.run import SCHEMA_VERSION, Run, SequenceResult
from core.results.store import Store

BACKEND_ORDER = ("vllm", "hf")  # vLLM first: HF then gathers its own values on vLLM's top-k ids


def _identity(spec: RunSpec, model: ResolvedModel, dtype: str, device: str) -> dict[str, Any]:
    v = versions()
    return {
        "schema": SCHEMA_VERSION,
        "model": model.identity,
        "dtype": dtype,
        "backends": sorted(spec.backends),
        "settings": spec.settings.run_id_part(),
        "top_k": spec.top_k,
        "bos": spec.bos,
        "versions": {k: v[k] for k in ("torch", "transformers", "vllm")},
        "device": device_name(device),
    }


def request_key(spec: RunSpec, model: ResolvedModel, dtype: str, device: str) -> str:
    """Hash of the request before tokenizing: the same request maps to the same stored run."""
    return content_hash({**_identity(spec, model, dtype, device), "texts": list(spec.texts), "truncate": spec.truncate}, 32)


def run_id_for(spec: RunSpec, model: ResolvedModel, dtype: str, device: str, toks: list[TokenizedText], max_model_len: int) -> str:
    """Content address: everything that can change a number, the token ids included."""
    return content_hash(
        {
            **_identity(spec, model, dtype, device),
            "texts": [t.text for t in toks],
            "token_ids": [list(t.token_ids) for t in toks],
            "max_model_len": max_model_len,
        }
    )


_inflight_lock = threading.Lock()
_inflight: dict[str, threading.Lock] = {}


def _request_lock(key: str) -> threading.Lock:
    """One lock per request key: identical concurrent requests compute once, the rest wait and read the store."""
    with _inflight_lock:
        return _inflight.setdefault(key, threading.Lock())


def compare(
    spec: RunSpec,
    ctx: Context | None = None,
    use_cache: bool = True,
    *,
    store: Store | None = None,
    on_event: EventFn | None = None,
    model_roots: list[str] | None = None,
) -> list[Run]:
    """One stored Run per dtype, in spec order. Cached runs come back without starting an engine.

    ctx carries the store, the allowed model roots and the progress callback; the keyword
    arguments build one when it is not given (model_roots None: anywhere, see core.inputs.models).
    """
    ctx = ctx or Context.of(store=store, on_event=on_event, model_roots=model_roots)
    return compare_prepared(prepare(spec, ctx), use_cache)


def compare_prepared(p: Prepared, use_cache: bool = True) -> list[Run]:
    """`compare` for a request already through `prepare` (diagnostics reuse theirs)."""
    keys = {d: request_key(p.spec, p.model, d, p.device) for d in p.spec.dtypes}
    with ExitStack() as held:
        for key in sorted(keys.values()):  # a fixed order: no two requests deadlock
            held.enter_context(_request_lock(key))
        return _compare_locked(p, use_cache, keys)


def _compare_locked(p: Prepared, use_cache: bool, keys: dict[str, str]) -> list[Run]:
    ctx, spec = p.ctx, p.spec
    runs: dict[str, Run] = {}
    if use_cache:
        for d, key in keys.items():
            rid = ctx.store.lookup_request(key)
            if rid:
                runs[d] = ctx.store.load(rid)
                ctx.emit("cache", d, f"run {rid} from the store, no engine started")
    todo = [d for d in spec.dtypes if d not in runs]
    if not todo:
        return [runs[d] for d in spec.dtypes]

    ctx.emit("tokenize", None, f"{len(spec.texts)} text(s)")
    p.toks  # noqa: B018 - tokenize now: bad input fails before any engine starts
    plan = {d: [p.load(b, d) for b in BACKEND_ORDER] for d in todo}
    everything = [r for rs in plan.values() for r in rs]
    # Every engine at once when they all fit (they load side by side); otherwise dtype after dtype.
    if ctx.pool.fits_together(everything):
        steps = [(todo, everything)]
    else:
        steps = [([d], plan[d]) for d in todo]
    for dtypes, requests in steps:
        with ctx.pool.lease(requests, on_wait=ctx.waiter(dtypes[0])) as lease:
            for d in dtypes:
                run = _score_dtype(p, d, plan[d], lease)
                ctx.store.save(run, request_key=keys[d])
                ctx.emit("store", d, f"run {run.run_id} saved")
                runs[d] = run
    return [runs[d] for d in spec.dtypes]


def _score_dtype(p: Prepared, dtype: str, requests: list[Any], lease: Lease) -> Run:
    ctx, spec = p.ctx, p.spec
    t0 = time.perf_counter()
    infos, timing, scores = {}, {}, {}
    seqs = p.seqs
    # the exact full-vocabulary KL: vLLM leaves its full logprobs in a shared-memory folder, HF reads them
    folder, why_not = fullvocab.folder_for(sum(len(s) - 1 for s in seqs), p.model.vocab_size)
    via = None
    try:
        for req in requests:
            b = req.backend
            ctx.emit("load", dtype, f"{b}: warm engine" if lease.warm(req) else
                     f"{b}: starting the engine (on a CPU about 20-60 s; it stays warm for the next run)")
            t = time.perf_counter()
            host = lease.host(req)
            infos[b] = host.info
            timing[f"{b}_load_s"] = round(time.perf_counter() - t, 3)
            gather = [s.topk_ids for s in scores["vllm"]] if b == "hf" else None
            if b == "hf" and folder is not None and why_not is None:
                why_not = fullvocab.problem(folder)  # vLLM could not leave its full logprobs there
                via = fullvocab.runner(folder)
            full = folder if why_not is None else None
            with ctx.pool.device_turn(ctx.waiter(dtype), what=f"{b} scoring"):
                ctx.emit("score", dtype, f"{b}: {sum(map(len, seqs))} tokens")
                t = time.perf_counter()
                scores[b] = lease.call(req, lambda: host.score(seqs, spec.top_k, gather, None, "right", full))
            timing[f"{b}_score_s"] = round(time.perf_counter() - t, 3)
    finally:
        fullvocab.remove(folder)
    kl_full = (f"exact, every position{f' (from vLLM’s {via} model runner)' if via else ''}" if why_not is None
               else f"not computed: {why_not}")
    infos["vllm"] = {**(infos.get("vllm") or {}), "kl_full": kl_full}
    ctx.emit("compare", dtype, "metrics")
    results = tuple(SequenceResult.build(t, h, v, p.decode) for t, h, v in zip(p.toks, scores["hf"], scores["vllm"]))
    summary = summarize(concat([r.metrics for r in results]))
    mml = p.max_model_len
    rid = run_id_for(spec, p.model, dtype, p.device, p.toks, mml)
    now = dt.datetime.now(dt.timezone.utc)
    v = versions()
    meta = RunMeta(
        run_id=rid,
        created=now.isoformat(timespec="seconds"),
        created_ts=now.timestamp(),
        model=p.model.name,
        model_path=p.model.path,
        revision=p.model.revision,
        model_identity=p.model.identity,
        dtype=dtype,
        backends=tuple(spec.backends),
        settings={**spec.settings.to_dict(), "max_model_len": mml},
        top_k=spec.top_k,
        bos=spec.bos,
        device=p.device,
        env=RunEnv(device=device_name(p.device), torch=v["torch"], transformers=v["transformers"], vllm=v["vllm"],
                   vllm_dist=v["vllm_dist"], hf_engine=infos["hf"], vllm_engine=infos["vllm"]),
        timing={**timing, "total_s": round(time.perf_counter() - t0, 3)},
        summary=summary,
        sequences=tuple(SequenceInfo(r.text, r.bos_added, len(r.token_ids), r.summary, tk.cut_from) for r, tk in zip(results, p.toks)),
    )
    return Run(meta=meta, sequences=results)
