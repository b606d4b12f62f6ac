"""Warm engine hosts, one per (backend, model, dtype, device, settings, max_model_len), reused across runs."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from core.spec import EngineSettings, canonical_json
from core.worker import WorkerClient

_lock = threading.Lock()
# Warm hosts kept at most (LPP_MAX_WARM_ENGINES); beyond it the least recently used idle one stops.
MAX_WARM_ENV = "LPP_MAX_WARM_ENGINES"
IDLE_BEFORE_EVICT_S = 30.0
MAX_GPU_ENV = "LPP_MAX_GPU_ENGINES"
_workers: dict[str, WorkerClient] = {}
_key_locks: dict[str, threading.Lock] = {}
# One scoring job on the device at a time: engines share the GPU (or the CPU cores).
device_lock = threading.Lock()
# Warm hosts kept at most (LPP_MAX_WARM_ENGINES); beyond it the least recently used idle one stops.
MAX_WARM_ENV = "LPP_MAX_WARM_ENGINES"
IDLE_BEFORE_EVICT_S = 30.0
MAX_GPU_ENV = "LPP_MAX_GPU_ENGINES"


def engine_key(backend: str, load_kwargs: dict[str, Any]) -> str:
    """Only the settings a backend reads split its engines: an HF knob never restarts vLLM."""
    settings = EngineSettings.from_dict(load_kwargs["settings"])
    part = settings.hf_part() if backend == "hf" else settings.vllm_part()
    return canonical_json({"backend": backend, **load_kwargs, "settings": part})


def worker_for(backend: str, load_kwargs: dict[str, Any]) -> WorkerClient:
    """A loaded engine host for this key, started if needed."""
    worker, _ = start_engine(backend, load_kwargs)
    ensure_loaded(backend, load_kwargs, worker)
    return worker


def start_engine(backend: str, load_kwargs: dict[str, Any]) -> tuple[WorkerClient, bool]:
    """Return a running host for this key (starting its process if needed) and whether it was warm.

    The caller calls `ensure_loaded` next; starting and loading are split so that several engines
    can start their processes at once and load side by side.
    """
    key = engine_key(backend, load_kwargs)
    with _lock:
        worker = _workers.get(key)
        if worker is not None and worker.alive() and worker.info is not None:
            return worker, True
        if worker is not None and not worker.alive():
            worker.stop()
            _workers.pop(key, None)
            worker = None
        if worker is None:
            _evict_idle_locked()
            if backend == "vllm" and load_kwargs["device"] == "cuda":
                _evict_gpu_engines_locked()
            label = f"{backend} ({load_kwargs['dtype']})"
            worker = WorkerClient(label).start()
            _workers[key] = worker
        _key_locks.setdefault(key, threading.Lock())
    return worker, False


def ensure_loaded(backend: str, load_kwargs: dict[str, Any], worker: WorkerClient) -> dict[str, Any]:
    key = engine_key(backend, load_kwargs)
    with _key_locks[key]:
        if worker.info is None:
            try:
                worker.load(backend, load_kwargs)
            except BaseException:
                discard(worker)
                raise
        return worker.info  # type: ignore[return-value]


def _evict_idle_locked() -> None:
    """Stop least-recently-used hosts idle for a while until one more fits under the cap."""
    cap = int(os.environ.get(MAX_WARM_ENV, "8"))
    now = time.monotonic()
    idle = sorted(
        ((k, w) for k, w in _workers.items() if w.info is not None and now - w.last_used > IDLE_BEFORE_EVICT_S),
        key=lambda kw: kw[1].last_used,
    )
    while len(_workers) >= cap and idle:
        key, w = idle.pop(0)
        _workers.pop(key, None)
        w.stop(grace=5.0)


def _is_gpu_vllm(key: str) -> bool:
    parts = json.loads(key)
    return parts["backend"] == "vllm" and parts["device"] == "cuda"


def _evict_gpu_engines_locked() -> None:
    """On one GPU, warm vLLM engines hold their share of its memory: keep at most
    LPP_MAX_GPU_ENGINES (default 3) and stop the least recently used to make room."""
    cap = int(os.environ.get(MAX_GPU_ENV, "3"))
    gpu = sorted(
        ((k, w) for k, w in _workers.items() if w.info is not None and _is_gpu_vllm(k)),
        key=lambda kw: kw[1].last_used,
    )
    while len(gpu) >= cap:
        key, w = gpu.pop(0)
        _workers.pop(key, None)
        w.stop(grace=10.0)


def discard(worker: WorkerClient) -> None:
    """Stop a host and forget it; the next request for its key starts a fresh one."""
    with _lock:
        for key, w in list(_workers.items()):
            if w is worker:
                _workers.pop(key)
    worker.stop(grace=2.0)


def running() -> list[WorkerClient]:
    with _lock:
        return [w for w in _workers.values() if w.alive()]


def shutdown_all() -> None:
    with _lock:
        workers = list(_workers.values())
        _workers.clear()
    for w in workers:
        w.stop()


atexit.register(shutdown_all)
