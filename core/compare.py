"""The pipeline: tokenize once, score the same ids with both engines, compare, store."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from core import engines, parallel
from core.env import device_name, dtype_support, resolve_device, versions
from core.errors import UserError
from core.memory import ELEM_BYTES
from core.metrics import concat, summarize
from core.models import ResolvedModel, resolve_model
from core.run import SCHEMA_VERSION, Run, SequenceResult
from core.spec import RunSpec, content_hash
from core.store import Store
from core.tokens import TokenizedText, load_tokenizer, tokenize
from core.tokens import truncate as truncate_tokens

# on_event(stage, dtype or None, detail): stages are resolve, cache, tokenize, load, score, compare, store.
EventFn = Callable[[str, "str | None", str], None]


def _noop(stage: str, dtype: str | None, detail: str) -> None:
    pass


def model_max_len(longest: int, max_positions: int | None) -> int:
    """vLLM's max_model_len: a power of two above the longest sequence (so a warm engine serves
    later, slightly longer prompts), at least 256, never above the model's positions."""
    n = 256
    while n < longest + 1:
        n *= 2
    return min(n, max_positions) if max_positions else n


def _identity(spec: RunSpec, model: ResolvedModel, dtype: str, device: str) -> dict[str, Any]:
    v = versions()
    return {
        "schema": SCHEMA_VERSION,
        "model": model.identity,
        "dtype": dtype,
        "backends": sorted(spec.backends),
        "settings": spec.settings.to_dict(),
        "top_k": spec.top_k,
        "bos": spec.bos,
        "versions": {k: v[k] for k in ("torch", "transformers", "vllm")},
        "device": device_name(device),
    }


def load_kwargs(model: ResolvedModel, dtype: str, device: str, settings: Any, max_model_len: int) -> dict[str, Any]:
    """What a worker needs to load an engine (and, with the backend, what keys it in the pool)."""
    return {"model_path": model.path, "dtype": dtype, "device": device, "settings": settings.to_dict(), "max_model_len": max_model_len}


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


def check_lengths(toks: list[TokenizedText], model: ResolvedModel, top_k: int, truncate: bool = False) -> list[TokenizedText]:
    """Refuse (or, with truncate, cut) prompts longer than the model's positions allow: vLLM keeps
    one position for the token it must generate, so a prompt may use all but one."""
    limit = None if model.max_positions is None else model.max_positions - 1
    out = []
    for i, t in enumerate(toks):
        if limit is not None and len(t.token_ids) > limit:
            if not truncate:
                raise UserError(
                    f"prompt {i + 1} is {len(t.token_ids)} tokens but {model.name} has {model.max_positions} positions "
                    f"(vLLM keeps one for the token it generates); shorten it, or truncate (--truncate) to keep "
                    f"its first {limit} tokens"
                )
            t = truncate_tokens(t, limit)
        out.append(t)
    vocab = model.vocab_size
    if vocab is not None and top_k > vocab:
        raise UserError(f"top-k {top_k} is above the vocabulary size {vocab}")
    return out


_inflight_lock = threading.Lock()
_inflight: dict[str, threading.Lock] = {}


def _request_lock(key: str) -> threading.Lock:
    """One lock per request key: identical concurrent requests compute once, the rest wait and read the store."""
    with _inflight_lock:
        return _inflight.setdefault(key, threading.Lock())


def compare(
    spec: RunSpec,
    store: Store | None = None,
    use_cache: bool = True,
    on_event: EventFn | None = None,
    model_roots: list[str] | None = None,
) -> list[Run]:
    """One stored Run per dtype, in spec order. Cached runs come back without starting an engine.

    model_roots: where local model folders may come from (None: anywhere; see core.models).
    """
    emit = on_event or _noop
    spec.validate()
    device = resolve_device(spec.device)
    for d in spec.dtypes:
        reason = dtype_support(d, device)
        if reason:
            raise UserError(f"{d} cannot run on this device: {reason}")
    store = store or Store()
    emit("resolve", None, f"model {spec.model or 'demo'}")
    model = resolve_model(spec.model, spec.revision, spec.settings.trust_remote_code, model_roots)
    widest = max(spec.dtypes, key=ELEM_BYTES.__getitem__)  # one parallel plan for every dtype of the request
    spec = dataclasses.replace(spec, settings=parallel.resolve(spec.settings, model.path, widest, device))
    keys = {d: request_key(spec, model, d, device) for d in spec.dtypes}
    with ExitStack() as held:
        for key in sorted(keys.values()):  # a fixed order: no two requests deadlock
            held.enter_context(_request_lock(key))
        return _compare_locked(spec, store, use_cache, emit, device, model, keys)


def _compare_locked(spec, store, use_cache, emit, device, model, keys) -> list[Run]:
    runs: dict[str, Run] = {}
    if use_cache:
        for d, key in keys.items():
            rid = store.lookup_request(key)
            if rid:
                runs[d] = store.load(rid)
                emit("cache", d, f"run {rid} from the store, no engine started")
    todo = [d for d in spec.dtypes if d not in runs]
    if not todo:
        return [runs[d] for d in spec.dtypes]

    emit("tokenize", None, f"{len(spec.texts)} text(s)")
    tokenizer = load_tokenizer(model.path, spec.settings.trust_remote_code)
    toks = check_lengths([tokenize(tokenizer, text, spec.bos) for text in spec.texts], model, spec.top_k, spec.truncate)
    max_model_len = model_max_len(max(len(t.token_ids) for t in toks), model.max_positions)
    seqs = [list(t.token_ids) for t in toks]

    # Start every engine process first so they load side by side when they all fit in free memory
    # (warm idle engines may be stopped for them); otherwise dtype after dtype.
    plan = [(d, load_kwargs(model, d, device, spec.settings, max_model_len)) for d in todo]
    started: dict[tuple[str, str], Any] = {}

    def start(d: str, load: dict[str, Any]) -> None:
        for b in ("vllm", "hf"):
            started[(d, b)] = engines.start_engine(b, load)

    decode = decoder(tokenizer)  # one memo for every dtype
    try:
        if engines.fits_together([(b, load) for _, load in plan for b in ("vllm", "hf")]):
            for d, load in plan:
                start(d, load)
        for d, load in plan:
            if (d, "vllm") not in started:
                start(d, load)
            run = _score_dtype(spec, model, device, d, load, toks, seqs, max_model_len, started, emit, decode)
            store.save(run, request_key=keys[d])
            emit("store", d, f"run {run.run_id} saved")
            runs[d] = run
    except BaseException:
        for worker, _ in started.values():  # started for this request but never loaded: not worth keeping
            if worker.info is None:
                engines.discard(worker)
        raise
    return [runs[d] for d in spec.dtypes]


def decoder(tokenizer: Any) -> Callable[[int], str]:
    """Token id -> the text it decodes to alone (memoised: top-k lists repeat ids)."""
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tokenizer.decode([i])
        return cache[i]

    return decode


def _score_dtype(spec, model, device, dtype, load, toks, seqs, max_model_len, started, emit, decode) -> Run:
    t0 = time.perf_counter()
    infos, timing = {}, {}
    scores = {}
    for b in ("vllm", "hf"):  # vLLM first: HF then gathers its own values on vLLM's top-k ids
        worker, warm = started[(dtype, b)]
        emit("load", dtype, f"{b}: {'warm engine' if warm else 'starting engine'}")
        t = time.perf_counter()
        infos[b] = engines.ensure_loaded(b, load, worker)
        timing[f"{b}_load_s"] = round(time.perf_counter() - t, 3)
        emit("score", dtype, f"{b}: {sum(map(len, seqs))} tokens")
        t = time.perf_counter()
        gather = [s.topk_ids for s in scores["vllm"]] if b == "hf" else None
        try:
            with engines.device_lock:
                scores[b] = worker.score(seqs, spec.top_k, gather)
        except BaseException:
            engines.discard(worker)  # a worker that failed mid-run is not trusted again
            raise
        timing[f"{b}_score_s"] = round(time.perf_counter() - t, 3)
    emit("compare", dtype, "metrics")
    results = tuple(SequenceResult.build(t, h, v, decode) for t, h, v in zip(toks, scores["hf"], scores["vllm"]))
    summary = summarize(concat([r.metrics for r in results]))
    rid = run_id_for(spec, model, dtype, device, toks, max_model_len)
    now = dt.datetime.now(dt.timezone.utc)
    v = versions()
    meta = {
        "run_id": rid,
        "created": now.isoformat(timespec="seconds"),
        "created_ts": now.timestamp(),
        "model": model.name,
        "model_path": model.path,
        "revision": model.revision,
        "model_identity": model.identity,
        "dtype": dtype,
        "backends": list(spec.backends),
        "settings": {**spec.settings.to_dict(), "max_model_len": max_model_len},
        "top_k": spec.top_k,
        "bos": spec.bos,
        "device": device,
        "env": {
            "device": device_name(device),
            "torch": v["torch"],
            "transformers": v["transformers"],
            "vllm": v["vllm"],
            "vllm_dist": v["vllm_dist"],
            "hf_engine": infos["hf"],
            "vllm_engine": infos["vllm"],
        },
        "timing": {**timing, "total_s": round(time.perf_counter() - t0, 3)},
        "summary": summary,
        "sequences": [{"text": r.text, "bos_added": r.bos_added, "n_positions": len(r.token_ids), "summary": r.summary} for r in results],
    }
    return Run(meta=meta, sequences=results)
