"""Warm engine hosts, one per (backend, model, dtype, device, settings, max_model_len), reused across runs.

Hosts stay warm between runs. They stop when idle longer than LPP_ENGINE_IDLE_TIMEOUT seconds
(default 1800; 0 keeps them), when more than LPP_MAX_WARM_ENGINES (default 8) are warm, or when a
new engine would not fit in the device's free memory: then the least recently used idle ones go first.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

from core import memory
from core.spec import EngineSettings, canonical_json
from core.worker import WorkerClient

MAX_WARM_ENV = "LPP_MAX_WARM_ENGINES"
IDLE_TIMEOUT_ENV = "LPP_ENGINE_IDLE_TIMEOUT"
# A host used within this many seconds is never evicted: a request may be about to use it.
IDLE_BEFORE_EVICT_S = 30.0
REAP_EVERY_S = 30.0

_lock = threading.Lock()
_workers: dict[str, WorkerClient] = {}
_key_locks: dict[str, threading.Lock] = {}
_reaper: threading.Thread | None = None
# One scoring job on the device at a time: engines share the GPU (or the CPU cores).
device_lock = threading.Lock()


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


def engine_bytes(backend: str, load_kwargs: dict[str, Any]) -> int:
    """What this engine will take on its device (per GPU), from the model's files."""
    settings = EngineSettings.from_dict(load_kwargs["settings"])
    return memory.engine_bytes(backend, load_kwargs["model_path"], load_kwargs["dtype"], load_kwargs["device"],
                               load_kwargs["max_model_len"], settings)


def start_engine(backend: str, load_kwargs: dict[str, Any]) -> tuple[WorkerClient, bool]:
    """Return a running host for this key (starting its process if needed) and whether it was warm.

    A new host starts loading at once, in the background; the caller waits with `ensure_loaded`,
    so engines started one after the other load side by side.
    """
    key = engine_key(backend, load_kwargs)
    with _lock:
        worker = _workers.get(key)
        if _warm(worker):
            worker.last_used = time.monotonic()  # claimed: not evicted while this request runs
            return worker, True
        if worker is not None and not worker.alive():
            worker.stop()
            _workers.pop(key, None)
            worker = None
        if worker is None:
            need = engine_bytes(backend, load_kwargs)
            _make_room_locked(load_kwargs["device"], need)
            worker = WorkerClient(f"{backend} ({load_kwargs['dtype']})", device=load_kwargs["device"], need_bytes=need).start()
            worker.begin_load(backend, load_kwargs)
            _workers[key] = worker
        _key_locks.setdefault(key, threading.Lock())
        _start_reaper_locked()
    return worker, False


def ensure_loaded(backend: str, load_kwargs: dict[str, Any], worker: WorkerClient) -> dict[str, Any]:
    key = engine_key(backend, load_kwargs)
    with _key_locks[key]:
        if worker.info is None:
            try:
                worker.wait_loaded()
            except BaseException:
                discard(worker)
                raise
        return worker.info  # type: ignore[return-value]


def fits_together(needs: list[tuple[str, dict[str, Any]]]) -> bool:
    """Whether these engines (backend, load kwargs) fit in the device's free memory at once,
    counting warm idle hosts that could be stopped for them."""
    cold = [(b, lk) for b, lk in needs if not _is_warm(engine_key(b, lk))]
    if not cold:
        return True
    device = cold[0][1]["device"]
    with _lock:
        reclaimable = sum(w.need_bytes for w in _idle_locked(device))
    return sum(engine_bytes(b, lk) for b, lk in cold) <= memory.free_bytes(device) + reclaimable


def _warm(worker: WorkerClient | None) -> bool:
    """Running and loaded: it can score now."""
    return worker is not None and worker.alive() and worker.info is not None


def _is_warm(key: str) -> bool:
    with _lock:
        return _warm(_workers.get(key))


def _idle_locked(device: str | None = None, longer_than: float | None = None) -> list[WorkerClient]:
    """Loaded hosts with no request in flight, unused for `longer_than` seconds (default
    IDLE_BEFORE_EVICT_S), least recently used first."""
    longer_than = IDLE_BEFORE_EVICT_S if longer_than is None else longer_than
    now = time.monotonic()
    return sorted(
        (w for w in _workers.values()
         if w.info is not None and not w.busy and now - w.last_used > longer_than
         and (device is None or w.device == device)),
        key=lambda w: w.last_used,
    )


def _make_room_locked(device: str, need: int) -> None:
    """Stop idle hosts, least recently used first, until one more host fits under the count cap and
    `need` bytes fit in the device's free memory (less what hosts still loading will take)."""
    cap = int(os.environ.get(MAX_WARM_ENV, "8"))
    idle = _idle_locked()
    while len(_workers) >= cap and idle:
        _stop_locked(idle.pop(0))
    idle = _idle_locked(device)
    while idle:
        loading = sum(w.need_bytes for w in _workers.values() if w.info is None and w.device == device)
        if memory.free_bytes(device) - loading >= need:
            break
        _stop_locked(idle.pop(0))


def _forget_locked(worker: WorkerClient) -> None:
    for key, w in list(_workers.items()):
        if w is worker:
            _workers.pop(key)


def _stop_locked(worker: WorkerClient) -> None:
    _forget_locked(worker)
    worker.stop(grace=10.0)


def reap_idle() -> int:
    """Stop hosts idle longer than LPP_ENGINE_IDLE_TIMEOUT seconds; returns how many stopped."""
    timeout = float(os.environ.get(IDLE_TIMEOUT_ENV, "1800"))
    if timeout <= 0:
        return 0
    with _lock:
        old = _idle_locked(longer_than=timeout)
        for w in old:
            _stop_locked(w)
    return len(old)


def _reap_forever() -> None:
    while True:
        time.sleep(min(REAP_EVERY_S, max(float(os.environ.get(IDLE_TIMEOUT_ENV, "1800")), 1.0)))
        reap_idle()


def _start_reaper_locked() -> None:
    global _reaper
    if _reaper is None:
        _reaper = threading.Thread(target=_reap_forever, name="lpp-engine-reaper", daemon=True)
        _reaper.start()


def discard(worker: WorkerClient) -> None:
    """Stop a host and forget it; the next request for its key starts a fresh one."""
    with _lock:
        _forget_locked(worker)
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
