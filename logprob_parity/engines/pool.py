"""The engine pool: warm engine hosts, one per LoadRequest key, leased out to requests.

Why counted leases: a host is stopped only when no request holds it or was promised it. A request
that queues behind another user's job keeps its engines however long it waits (the old 30 s
"recently used" guard did not). Requests take every engine of one step in a single lease, so two
requests never wait for each other's engines.

Why spares and swaps: most of a small model's engine start is the process importing torch and its
engine (vLLM: about 7 of 10 s on a CPU), not the model. So a pool that keeps spares (the dashboard
and the test suite; `keep_spares`) keeps one started host per backend that has done its imports
and waits for whichever model comes next; and a host stopped to make room for an engine of the
same backend loads that engine in its own process instead (a swap), keeping its imports.

Hosts stay warm between requests. Idle ones (no lease) stop when unused longer than
LPP_ENGINE_IDLE_TIMEOUT seconds (default 1800; 0 keeps them), when more than LPP_MAX_WARM_ENGINES
(default 8) would be running, or when a new engine would not fit in the device's free memory: the
least recently used go first. When the room can only come from engines other requests hold, the
new request waits (and says so) until they are released. Stopping happens outside the pool's lock.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from logprob_parity.engines import memory
from logprob_parity.engines.host import HostClient, env_print
from logprob_parity.engines.records import LoadRequest
from logprob_parity.engines.zygote import ZYGOTE_ENV

MAX_WARM_ENV = "LPP_MAX_WARM_ENGINES"
# "1": a host whose model is stopped to make room loads the next model in its own process on a GPU
# too; "0": never. Default: on a CPU only (on a GPU, a swap's freed memory is not yet measured).
SWAP_ENV = "LPP_ENGINE_SWAP"
IDLE_TIMEOUT_ENV = "LPP_ENGINE_IDLE_TIMEOUT"
REAP_EVERY_S = 30.0
WaitFn = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def engine_bytes(request: LoadRequest) -> int:
    """What this engine will take on its device (per GPU), from the model's files."""
    return memory.engine_bytes(
        request.backend, request.model_path, request.dtype, request.device, request.max_model_len, request.settings
    )


class Lease:
    """Engines held for one request. `host(r)` waits until r's engine has loaded; leaving the
    `with` block (or `release()`) gives them back, warm."""

    def __init__(self, pool: EnginePool, hosts: dict[str, tuple[HostClient, bool]], owner: int) -> None:
        self._pool = pool
        self._hosts = hosts
        self._owner = owner
        self._released = False

    def warm(self, request: LoadRequest) -> bool:
        """Whether the engine was already loaded when the lease was granted."""
        return self._hosts[request.key()][1]

    def host(self, request: LoadRequest) -> HostClient:
        host = self._hosts[request.key()][0]
        if host.info is None:
            try:
                host.wait_loaded()
            except BaseException:
                self._pool.discard(host)
                raise
        return host

    def discard(self, request: LoadRequest) -> None:
        """Stop this engine: it failed mid-request and is not trusted again."""
        self._pool.discard(self._hosts[request.key()][0])

    def call(self, request: LoadRequest, work: Callable[[], Any]) -> Any:
        """work() on this request's engine; if it fails, the engine is stopped: a host that failed
        mid-run is not trusted again."""
        try:
            return work()
        except BaseException:
            self.discard(request)
            raise

    def discard_unloaded(self) -> None:
        """Stop engines started for this lease that never finished loading: not worth keeping."""
        for host, _ in self._hosts.values():
            if host.info is None:
                self._pool.discard(host)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release([h for h, _ in self._hosts.values()], self._owner)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            self.discard_unloaded()
        self.release()


class TurnLease:
    """The engines of one request that do not fit on the device together (engines in turn): one holds
    the device at a time. The pool's lease of one engine alone is taken when that engine is needed;
    the pool, bound by the memory cap, puts the other to sleep (a GPU) or stops it (a CPU) to make room.

    It answers like a `Lease`, so every analysis runs in turn unchanged: `host(r)` returns a stand-in
    whose methods first give r's engine the device (`TurnHost`), and `call(r, work)` does the same
    before `work`. Rows for the exact KL go through files (`transport`), which outlive a turn."""

    transport = "files"

    def __init__(self, pool: EnginePool, requests: list[LoadRequest], on_wait: WaitFn | None = None) -> None:
        self._pool = pool
        self._requests = {r.key(): r for r in requests}
        self._on_wait = on_wait
        self._lease: Lease | None = None
        self._active: str | None = None
        self._hosts: dict[str, HostClient] = {}  # each engine's latest host (its `info` stays readable)
        self._warm: dict[str, bool] = {}
        self.switches = 0  # times one engine took the device from the other

    def _take(self, request: LoadRequest) -> HostClient:
        """`request`'s engine, holding the device (loaded, or woken)."""
        key = request.key()
        if self._active != key:
            if self._lease is not None:
                self._lease.release()
                self.switches += 1
            self._lease = None
            lease = self._pool.lease([request], on_wait=self._on_wait)
            self._lease, self._active = lease, key
            self._warm.setdefault(key, lease.warm(request))
        assert self._lease is not None
        host = self._lease.host(request)
        self._hosts[key] = host
        return host

    def host(self, request: LoadRequest) -> TurnHost:
        """A stand-in for the engine's host: it takes the device at its first call, not now, so asking
        for both hosts up front (as a side-by-side run does) costs no turn."""
        return TurnHost(self, request)

    def warm(self, request: LoadRequest) -> bool:
        return self._warm.get(request.key(), False)

    def call(self, request: LoadRequest, work: Callable[[], Any]) -> Any:
        self._take(request)
        assert self._lease is not None
        return self._lease.call(request, work)

    def discard(self, request: LoadRequest) -> None:
        if self._lease is not None and self._active == request.key():
            self._lease.discard(request)

    def discard_unloaded(self) -> None:
        if self._lease is not None:
            self._lease.discard_unloaded()

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease, self._active = None, None

    def __enter__(self) -> TurnLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            self.discard_unloaded()
        self.release()


class TurnHost:
    """A `TurnLease`'s stand-in for one engine's host: a method call gives that engine the device
    first (its host may be another process by then, on a CPU where the engine was stopped for the
    other's turn); reading a plain attribute (`info`) takes no turn."""

    def __init__(self, turns: TurnLease, request: LoadRequest) -> None:
        self._turns, self._request = turns, request

    def __getattr__(self, name: str) -> Any:
        latest = self._turns._hosts.get(self._request.key()) or self._turns._take(self._request)
        if not callable(getattr(latest, name)):
            return getattr(latest, name)

        def in_turn(*args: Any, **kwargs: Any) -> Any:
            return getattr(self._turns._take(self._request), name)(*args, **kwargs)

        return in_turn


class EnginePool:
    def __init__(self, host_factory: Callable[..., HostClient] = HostClient, keep_spares: bool = False) -> None:
        self._cond = threading.Condition()
        self._hosts: dict[str, HostClient] = {}
        # a long-lived process (the dashboard, the test suite) keeps a spare per backend; a one-shot CLI
        # does not: a spare it started would import for nothing while the command finishes
        self.keep_spares = keep_spares
        self._spares: dict[tuple[Any, ...], HostClient] = {}
        self._host_factory = host_factory
        self._reaper: threading.Thread | None = None
        self._device = threading.Lock()
        self._line = 0  # jobs waiting for the device

    # -- leases ----------------------------------------------------------------------------------
    def lease(self, requests: list[LoadRequest], on_wait: WaitFn | None = None) -> Lease:
        """Hosts for every request, started now if cold (they load side by side in the background).
        Waits while the room they need is held by other requests' leases."""
        on_wait = on_wait or _quiet
        owner = threading.get_ident()
        unique = list({r.key(): r for r in requests}.values())
        victims: list[HostClient] = []
        said, said_at = None, 0.0
        t0 = time.monotonic()
        sleepers: list[HostClient] = []
        waking: list[HostClient] = []
        loads: list[tuple[HostClient, LoadRequest]] = []
        with self._cond:
            while True:
                victims += self._drop_dead_locked()
                # an engine asleep (engines in turn) needs its room back as much as a cold one
                cold = [r for r in unique if r.key() not in self._hosts or self._hosts[r.key()].asleep]
                room = self._room_locked(cold)
                if room is not None:
                    break
                held = self._held_by_others_locked(owner)
                if not held:  # nothing will be released: go over the limits rather than wait forever
                    wanted = {r.key() for r in cold}
                    room = [h for h in self._idle_locked() if h.request is None or h.request.key() not in wanted]
                    break
                message = (
                    f"queued: waiting for {held} engine(s) held by other jobs to free room "
                    f"(limit {self._cap()} warm engines and the device's free memory)"
                )
                now = time.monotonic()
                if message != said or now - said_at >= 5:
                    on_wait(f"{message}, {now - t0:.0f} s so far")
                    said, said_at = message, now
                self._cond.wait(1.0)
            for v in room:
                if _can_sleep(v):  # under a cap on a GPU: it leaves the device but stays warm
                    sleepers.append(v)
                    v.asleep, v.need_bytes = True, memory.PROCESS_OVERHEAD.get(v.device, 0)
                else:
                    self._forget_locked(v)
                    victims.append(v)
            hosts: dict[str, tuple[HostClient, bool]] = {}
            for r in unique:
                key = r.key()
                host = self._hosts.get(key)
                if host is None:
                    # a spare that has done its imports, else a host stopped for room (its imports
                    # stay), else a new process
                    host = self._take_spare_locked(r) or _take_swappable(victims, r)
                    if host is None:
                        host = self._host_factory(r.label, extra_env=r.host_env(), device=r.device).start()
                    host.need_bytes = engine_bytes(r)
                    if sleepers or any(v.device.startswith("cuda") for v in victims):
                        host.expect_load(r)  # loads once the device is free, below
                        loads.append((host, r))
                    else:  # nothing to free first: it starts loading now, as every start did before
                        host.begin_load(r)
                    self._hosts[key] = host
                elif host.asleep:
                    host.asleep, host.need_bytes = False, engine_bytes(r)
                    host.expect_wake()
                    waking.append(host)
                host.leases += 1
                host.owners[owner] = host.owners.get(owner, 0) + 1
                host.last_used = time.monotonic()
                hosts[key] = (host, host.info is not None or host in waking)
            self._start_reaper_locked()
        # the device is made free before anything takes it: engines asleep first, then (on a GPU) those
        # stopped; a CPU's stops overlap the next loads as before
        failed = [h for h in sleepers if not _sleep(h)]
        if failed or any(h.device.startswith("cuda") for h in victims):
            with self._cond:
                for h in failed:
                    self._forget_locked(h)
            _stop_all(victims + failed, grace=10.0)
            victims = []
        for host, r in loads:
            host.begin_load(r)
        for host in waking:
            try:
                host.finish_wake()
            except BaseException:
                self.discard(host)
                raise
        _stop_all(victims, grace=10.0)
        return Lease(self, hosts, owner)

    def lease_for(self, requests: list[LoadRequest], in_turn: bool, on_wait: WaitFn | None = None) -> Lease | TurnLease:
        """`lease`, or a `TurnLease` when the engines run in turn (logprob_parity.analysis.turns.fit_of)."""
        return TurnLease(self, requests, on_wait) if in_turn else self.lease(requests, on_wait)

    def _release(self, hosts: list[HostClient], owner: int) -> None:
        with self._cond:
            for h in hosts:
                h.leases = max(0, h.leases - 1)
                left = h.owners.get(owner, 0) - 1
                if left > 0:
                    h.owners[owner] = left
                else:
                    h.owners.pop(owner, None)
                h.last_used = time.monotonic()
            if self.keep_spares:  # the job is done: the next model's imports happen while nothing runs
                for h in hosts:
                    if h.request is not None:
                        self._keep_spare_locked(h.request)
            self._cond.notify_all()

    # -- spares: hosts that did their imports and wait for a model -------------------------------
    def _keep_spare_locked(self, request: LoadRequest) -> None:
        if os.environ.get(ZYGOTE_ENV):  # hosts are forked with their imports done: no spare needed
            return
        kind = _spare_kind(request)
        for other in [k for k in self._spares if k[:2] == kind[:2] and k != kind]:  # started for another environment
            stale = self._spares.pop(other)
            threading.Thread(target=stale.stop, kwargs={"grace": 2.0}, daemon=True).start()
        spare = self._spares.get(kind)
        if spare is not None and not spare.alive():  # a spare that died: its socket folder goes too
            threading.Thread(target=spare.stop, kwargs={"grace": 0.0}, daemon=True).start()
        if spare is None or not spare.alive():
            self._spares[kind] = (
                self._host_factory(f"spare {request.backend}", extra_env=request.host_env(), device=request.device)
                .start(spare=True)
                .prepare(request.backend)
            )

    def _take_spare_locked(self, request: LoadRequest) -> HostClient | None:
        spare = self._spares.pop(_spare_kind(request), None)
        if spare is not None and not spare.alive():
            spare.stop(grace=0.0)
            return None
        return spare

    def spares(self) -> list[HostClient]:
        """The spare hosts (imports done, no model) alive now."""
        with self._cond:
            return [h for h in self._spares.values() if h.alive()]

    def _held_by_others_locked(self, owner: int) -> int:
        return sum(1 for h in self._hosts.values() if any(o != owner for o in h.owners))

    @staticmethod
    def _cap() -> int:
        return int(os.environ.get(MAX_WARM_ENV, "8"))

    def _idle_locked(self, device: str | None = None, longer_than: float = 0.0) -> list[HostClient]:
        """Hosts no request holds, unused for `longer_than` seconds, least recently used first."""
        now = time.monotonic()
        return sorted(
            (
                h
                for h in self._hosts.values()
                if h.leases == 0 and now - h.last_used >= longer_than and (device is None or h.device == device)
            ),
            key=lambda h: h.last_used,
        )

    def _room_locked(self, cold: list[LoadRequest]) -> list[HostClient] | None:
        """The idle hosts to stop so that `cold` fits under the count cap and in free memory;
        None when stopping every idle host would not be enough."""
        if not cold:
            return []
        wanted = {r.key() for r in cold}  # an engine asleep that a request wants is woken, never stopped for it
        idle = [h for h in self._idle_locked() if h.request is None or h.request.key() not in wanted]
        victims: list[HostClient] = []
        over = len(self._hosts) + len(cold) - self._cap()
        while over > 0:
            if not idle:
                return None
            victims.append(idle.pop(0))
            over -= 1
        for device in {r.device for r in cold}:
            need = sum(engine_bytes(r) for r in cold if r.device == device)
            cap = _cap(cold, device)
            loading = sum(h.need_bytes for h in self._hosts.values() if h.info is None and h.device == device)
            room = memory.free_bytes(device) - loading + sum(v.need_bytes for v in victims if v.device == device)
            # under a cap (settings.device_memory), every engine of ours on the device counts, loaded or not
            held = sum(h.need_bytes for h in self._hosts.values() if h.device == device and h not in victims)
            candidates = [h for h in idle if h.device == device]
            while room < need or (cap is not None and held + need > cap):
                if not candidates:
                    return None
                v = candidates.pop(0)
                idle.remove(v)
                victims.append(v)
                freed = v.need_bytes - (memory.PROCESS_OVERHEAD.get(device, 0) if _can_sleep(v) else 0)
                room += freed
                held -= freed
        return victims

    def _drop_dead_locked(self) -> list[HostClient]:
        dead = [h for h in self._hosts.values() if not h.alive()]
        for h in dead:
            self._forget_locked(h)
        return dead

    def _forget_locked(self, host: HostClient) -> None:
        for key, h in list(self._hosts.items()):
            if h is host:
                self._hosts.pop(key)
        self._cond.notify_all()

    # -- the device: one scoring job at a time --------------------------------------------------
    @contextmanager
    def device_turn(self, on_wait: WaitFn | None = None, what: str = "") -> Iterator[None]:
        """Engines share the GPU (or the CPU cores): one job scores at a time; the others wait in
        line and are told their place."""
        if not self._device.acquire(blocking=False):
            with self._cond:
                self._line += 1
                place = self._line
            t0 = time.monotonic()
            (on_wait or _quiet)(f"waiting for another job on the device ({place} in line){f' before {what}' if what else ''}")
            self._device.acquire()
            with self._cond:
                self._line -= 1
            (on_wait or _quiet)(f"the device is free after {time.monotonic() - t0:.0f} s in line")
        try:
            yield
        finally:
            self._device.release()

    # -- housekeeping ---------------------------------------------------------------------------
    def fits_together(self, requests: list[LoadRequest]) -> bool:
        """Whether these engines fit in the device's free memory at once, counting idle hosts that
        could be stopped for them, and under the count cap."""
        with self._cond:
            cold = [
                r
                for r in {r.key(): r for r in requests}.values()
                if r.key() not in self._hosts or not self._hosts[r.key()].alive() or self._hosts[r.key()].asleep
            ]
            if not cold:
                return True
            if len(cold) > self._cap():
                return False
            device = cold[0].device
            reclaimable = sum(h.need_bytes for h in self._idle_locked(device))
            held = sum(h.need_bytes for h in self._hosts.values() if h.device == device) - reclaimable
        need = sum(engine_bytes(r) for r in cold)
        cap = _cap(cold, device)
        return need <= memory.free_bytes(device) + reclaimable and (cap is None or held + need <= cap)

    def discard(self, host: HostClient) -> None:
        """Stop a host and forget it; the next request for its key starts a fresh one."""
        with self._cond:
            self._forget_locked(host)
        host.stop(grace=2.0)

    def engine_keys(self) -> list[str]:
        """The engine keys (LoadRequest.key) of the hosts alive now."""
        with self._cond:
            return [k for k, h in self._hosts.items() if h.alive()]

    def host_for(self, request: LoadRequest) -> HostClient | None:
        """The host of this engine key now (awake or asleep), if there is one."""
        with self._cond:
            return self._hosts.get(request.key())

    def running(self) -> list[HostClient]:
        with self._cond:
            return [h for h in self._hosts.values() if h.alive()]

    def make_host_room(
        self, need: int, free: int, keep: set[str], on_stop: Callable[[int], None] | None = None
    ) -> list[HostClient] | None:
        """Host memory for `need` bytes where `free` are free: a sleeping engine's weights (engines in turn,
        on a GPU), as `_room_locked` finds room on the device. When short, idle hosts that slept (their
        weights in host memory: a comparison's engines before a rollout of the same model, which starts
        its own) other than the engine keys in `keep` are stopped, if together they make the room;
        on_stop hears how many first. Returns the hosts stopped ([]: the room was there), or None when
        even they would not make it (then none is stopped)."""
        if need <= free:
            return []
        with self._cond:
            idle = [h for h in self._idle_locked() if h.slept and h.alive() and h.request is not None]
            others = [h for h in idle if h.request.key() not in keep]
            freed = sum(memory.weight_bytes(h.request.model_path, h.request.dtype) for h in others)
            if not others or need > free + freed:
                return None
            for h in others:
                self._forget_locked(h)
        if on_stop is not None:
            on_stop(len(others))
        _stop_all(others, grace=10.0)
        return others

    def reap_idle(self) -> int:
        """Stop hosts idle longer than LPP_ENGINE_IDLE_TIMEOUT seconds; returns how many stopped."""
        timeout = float(os.environ.get(IDLE_TIMEOUT_ENV, "1800"))
        if timeout <= 0:
            return 0
        with self._cond:
            old = [h for h in self._idle_locked(longer_than=timeout) if h.info is not None or not h.alive()]
            for h in old:
                self._forget_locked(h)
            now = time.monotonic()
            for kind, h in list(self._spares.items()):  # a spare nobody took since its last job
                if now - h.last_used >= timeout:
                    old.append(self._spares.pop(kind))
        _stop_all(old, grace=10.0)
        return len(old)

    def _reap_forever(self) -> None:
        while True:
            time.sleep(min(REAP_EVERY_S, max(float(os.environ.get(IDLE_TIMEOUT_ENV, "1800")), 1.0)))
            self.reap_idle()

    def _start_reaper_locked(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_forever, name="lpp-engine-reaper", daemon=True)
            self._reaper.start()

    def shutdown(self, grace: float = 5.0) -> None:
        """Stop every host at once (a dashboard that stops leaves no engine behind)."""
        with self._cond:
            hosts = list(self._hosts.values()) + list(self._spares.values())
            self._hosts.clear()
            self._spares.clear()
            self._cond.notify_all()
        _stop_all(hosts, grace=grace)


def _can_sleep(host: HostClient) -> bool:
    """Whether a host stopped for room may sleep instead: its engine loaded on a GPU under a memory cap
    (vLLM started with sleep mode then), in one process."""
    r = host.request
    return r is not None and host.info is not None and host.alive() and not host.asleep and r.sleeps() and _one_process(r)


def _sleep(host: HostClient) -> bool:
    """Put the host's engine to sleep; False when it cannot (or failed): the pool stops it then."""
    try:
        return host.sleep()
    except Exception:
        return False


def _cap(requests: list[LoadRequest], device: str) -> int | None:
    """The tightest device memory cap (settings.device_memory) these requests set on `device`, in bytes."""
    caps = [c for r in requests if r.device == device for c in [memory.cap_of(r.settings)] if c]
    return min(caps) if caps else None


def _spare_kind(request: LoadRequest) -> tuple[Any, ...]:
    """What a spare must share with an engine to load it: backend, device and the environment its
    process would start with."""
    return (request.backend, request.device, env_print(request.host_env()))


def swap_allowed(request: LoadRequest) -> bool:
    """Whether a host may load this engine in place of another: one process (no tensor or pipeline
    parallel workers, no Ray executor), on a CPU unless LPP_ENGINE_SWAP=1."""
    flag = os.environ.get(SWAP_ENV, "")
    if flag == "0":
        return False
    return _one_process(request) and (flag == "1" or request.device == "cpu")


def _one_process(request: LoadRequest) -> bool:
    """No tensor or pipeline parallel workers and no Ray executor: the engine lives in its host alone."""
    s = request.settings
    return (
        (getattr(s, "tensor_parallel_size", None) or 1) == 1
        and (getattr(s, "pipeline_parallel_size", None) or 1) == 1
        and getattr(s, "distributed_executor_backend", None) is None
    )


def _take_swappable(victims: list[HostClient], request: LoadRequest) -> HostClient | None:
    """A host about to be stopped for room whose process can load `request` instead: same backend,
    device and environment, its model loaded and both engines swappable. Taken off `victims`."""
    if not swap_allowed(request):
        return None
    for v in victims:
        old = v.request
        if (
            old is not None
            and v.info is not None
            and v.alive()
            and (old.backend, old.device) == (request.backend, request.device)
            and v.env_print == env_print(request.host_env())
            and swap_allowed(old)
        ):
            victims.remove(v)
            return v
    return None


def _stop_all(hosts: list[HostClient], grace: float) -> None:
    """Stop hosts side by side: each waits up to `grace` seconds for a clean exit, then is killed."""
    threads = [threading.Thread(target=h.stop, kwargs={"grace": grace}, daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(grace + 10.0)


POOL = EnginePool()
# The process-wide pool's verbs, for callers that do not pass their own.
lease = POOL.lease
device_turn = POOL.device_turn
fits_together = POOL.fits_together
discard = POOL.discard
running = POOL.running
reap_idle = POOL.reap_idle
shutdown_all = POOL.shutdown
atexit.register(POOL.shutdown)
