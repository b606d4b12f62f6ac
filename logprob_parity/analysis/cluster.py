"""Prompt sets and logged rollouts on a Ray cluster: workers that each hold one warm engine pair.

Why this shape:
- Each worker is a Ray actor that keeps its engines warm between batches (its own engine pool, in its
  own process), so an engine starts once per worker, not once per batch.
- Workers return each finished part (an Arrow table and its info) to the driver, which stores it in its
  own store as a single-process run stores its parts: no shared filesystem, and the driver's resume
  (a part already stored is not computed again) works unchanged.
- A worker that dies (its process, or its whole node) loses only the batch it held: that batch goes
  back in the queue for the others. A result is stored once per batch, so none is counted twice.
- The numbers are the single-process ones: each worker runs the same part function on the same ids.

Ray is an optional extra (`pip install 'logprob-parity[ray]'`): nothing imports it unless `--ray` is asked for.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from logprob_parity.errors import EngineError, UserError

RAY_MISSING = "Ray is not installed here: pip install 'logprob-parity[ray]' (or: pip install ray)"
IN_FLIGHT = 2  # jobs handed to one worker at a time
START_TIMEOUT_S = 180.0  # a worker that Ray cannot place (no room anywhere) is refused in words after this
FORWARDED_ENV = ("LPP_", "HF_", "VLLM_", "TRANSFORMERS_")  # engine options a driver's environment passes to its workers
# Ray sets these to a worker's CPUs; the engines' numbers depend on them on a CPU (HF's KV-cache chunks
# read another noise floor on one thread than on two), so a worker's engines get the driver's
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide. address: "local" starts a Ray instance on this machine, "auto" joins the one
    running here (`ray start --head`), anything else is a cluster's address (host:port or ray://...).
    gpus_per_worker: None means the engine plan's GPUs (1, or the tensor x pipeline parallel size) where
    the engines run on a GPU, 0 on a CPU (a fraction shares a card).
    workers: None means as many as the cluster's resources hold (on CPUs, one a node)."""

    address: str = "local"
    gpus_per_worker: float | None = None
    workers: int | None = None
    cpus_per_worker: float = 1.0

    @classmethod
    def of(cls, ray: Any) -> RayOptions | None:
        """The `ray=` argument of the Python API: None/False (off), True or "local", "auto", an address,
        a dict of these fields, or RayOptions."""
        if ray is None or ray is False:
            return None
        if isinstance(ray, RayOptions):
            return ray
        if ray is True:
            return cls()
        if isinstance(ray, str):
            return cls(address=ray or "local")
        if isinstance(ray, dict):
            return cls(**ray)
        raise UserError(f"ray= takes True, 'auto', an address or a dict of RayOptions fields, not {ray!r}")


def words_left(seconds: float) -> str:
    if seconds < 1:
        return "under a second left"
    if seconds < 90:
        return f"about {seconds:.0f} s left"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} min left"
    return f"about {seconds / 3600:.1f} h left"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise UserError(RAY_MISSING) from e
    return ray


def _check_answers(address: str) -> None:
    """An address that does not answer fails in words at once (ray.init would wait and retry)."""
    if address.startswith("ray://"):
        address = address[len("ray://") :]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address}: give host:port (e.g. 10.0.0.5:6379), 'auto' for the cluster running here, or nothing")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise UserError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): start one there with `ray start --head --port={port}`, "
            "or check the address"
        ) from e


def _connect(ray: Any, address: str) -> bool:
    """Join or start a cluster: True when this call started Ray in this process (and must stop it)."""
    if ray.is_initialized():  # a notebook that already called ray.init: use its cluster
        return False
    kwargs: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False, "include_dashboard": False}
    if address == "local":
        ray.init(**kwargs)
        return True
    if address != "auto":
        _check_answers(address)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        where = "on this machine" if address == "auto" else f"at {address}"
        raise UserError(
            f"no running Ray cluster found {where}: start one with `ray start --head`, give its address, "
            f"or leave the address out to start one here ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from e
    return True


class EngineWorker:
    """One Ray actor: a warm engine pair in its own pool, and the request it works for.

    `run("module:function", *args)` calls function(prepared, *args) here, the same function a
    single-process run calls (lm-eval's lazy "module:Class" registry, for functions): a new kind of
    work needs a function, not new plumbing."""

    def __init__(self, spec: Any, model: Any, device: str, threads: dict[str, str | None]) -> None:
        from logprob_parity.analysis.request import Context, Prepared
        from logprob_parity.results.store import Store

        for name, value in threads.items():  # the engine hosts this worker starts inherit these
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

        # a scratch store, one a machine (the part functions store nothing; the driver stores every
        # part): a folder of its own per worker would be left behind when Ray kills the worker
        ctx = Context.of(store=Store(os.path.join(tempfile.gettempdir(), "lpp-ray-worker-scratch")))
        self.prepared = Prepared(spec, ctx, model, device)

    def describe(self) -> dict[str, Any]:
        """Where this worker runs and what it would compute with: the driver refuses a worker whose
        versions or device differ from its own, since both are part of every run id."""
        import ray

        from logprob_parity.env import device_name, versions

        v = versions()
        return {
            "node": ray.get_runtime_context().get_node_id()[:8],
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "versions": {k: v[k] for k in ("torch", "transformers", "vllm")},
            "device": device_name(self.prepared.device),
        }

    def run(self, target: str, *args: Any) -> Any:
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(self.prepared, *args)


@dataclass
class _Worker:
    handle: Any
    number: int
    where: str = "?"
    alive: bool = True


@dataclass(frozen=True)
class Job:
    """One batch of work: `key` identifies it (the batch number), `tokens` counts its progress.
    `args` may be a function that makes them: then they are made when the job is handed out, so a
    run never holds every batch's inputs at once (a rescore's sequences stay in its staged file)."""

    key: int
    args: tuple[Any, ...] | Callable[[], tuple[Any, ...]]
    tokens: int

    def inputs(self) -> tuple[Any, ...]:
        return self.args() if callable(self.args) else self.args


class Cluster:
    """Workers on a Ray cluster, for one request (see `open_cluster`)."""

    def __init__(self, ray: Any, ctx: Any, workers: list[_Worker], address: str, per_worker: str) -> None:
        self._ray, self.ctx, self.workers, self.address, self.per_worker = ray, ctx, workers, address, per_worker

    @property
    def alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.alive]

    def words(self) -> str:
        nodes = len({w.where for w in self.alive})
        return f"{len(self.alive)} Ray worker(s) on {nodes} node(s), {self.per_worker} each"

    def _lost(self, w: _Worker, e: BaseException, dtype: str | None, what: str) -> None:
        w.alive = False
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        self.ctx.emit(
            "worker",
            dtype,
            f"worker {w.number} on {w.where} stopped ({first}); {what} goes to another worker; "
            f"{len(self.alive)} of {len(self.workers)} workers alive",
        )

    def _failed(self, e: Any, w: _Worker) -> BaseException:
        """A worker's own error (bad input, an engine that failed) as the driver's, with the worker named."""
        cause = getattr(e, "cause", None)
        if isinstance(cause, (UserError, EngineError)):
            return type(cause)(f"{cause} (Ray worker {w.number} on {w.where})")
        return EngineError(f"Ray worker {w.number} on {w.where} failed: {cause or e}")

    def _dead_errors(self) -> tuple[type, ...]:
        ex = self._ray.exceptions
        return tuple(
            getattr(ex, n) for n in ("RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError") if hasattr(ex, n)
        )

    def map(
        self,
        target: str,
        jobs: list[Job],
        on_done: Callable[[Job, Any, int], None],
        dtype: str | None = None,
        total: int | None = None,
        done: int = 0,
        unit: str = "tokens",
        batches: int | None = None,
    ) -> None:
        """Each job on one worker (target(prepared, *job.inputs()) there); on_done(job, result, worker number)
        here, once per job, in the order they finish. A worker that dies gives its job back to the queue;
        with none left, the run stops in words (what is stored stays stored)."""
        ray = self._ray
        dead = self._dead_errors()
        queue = collections.deque(jobs)
        running: dict[Any, tuple[_Worker, Job]] = {}
        # each worker holds IN_FLIGHT jobs: Ray runs an actor's calls one after another, so the next
        # batch starts on the worker while this process stores the last one
        slots = [w for _ in range(IN_FLIGHT) for w in self.alive]
        total = total if total is not None else done + sum(j.tokens for j in jobs)
        finished: set[int] = set()
        computed, t0 = 0, time.perf_counter()

        def fill() -> None:
            while queue and slots:
                w = slots.pop(0)
                if w.alive:
                    job = queue.popleft()
                    running[w.handle.run.remote(target, *job.inputs())] = (w, job)

        while queue or running:
            fill()
            if not running:
                raise EngineError(
                    f"every Ray worker stopped ({len(self.workers)} started); {len(finished)} of {len(jobs)} batches "
                    "are stored: run the same command again to compute the rest"
                )
            ready, _ = ray.wait(list(running), num_returns=1)
            w, job = running.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except dead as e:
                if w.alive:
                    self._lost(w, e, dtype, f"its batch {job.key + 1}")
                queue.appendleft(job)
                continue
            except ray.exceptions.RayTaskError as e:
                raise self._failed(e, w) from e
            slots.append(w)
            fill()  # the worker's next batch goes out before this one is stored
            if job.key in finished:  # cannot happen (a job runs on one worker at a time); never counted twice
                continue
            finished.add(job.key)
            on_done(job, result, w.number)
            done += job.tokens
            computed += job.tokens
            self.report(
                dtype,
                done,
                total,
                computed / (time.perf_counter() - t0),
                f"batch {job.key + 1}" + (f" of {batches}" if batches else ""),
                unit,
            )

    def report(self, dtype: str | None, done: int, total: int, rate: float, what: str, unit: str) -> None:
        """Progress over the cluster: done/total, tokens/s, time left and workers alive, as words
        (an event) and as numbers (ctx.on_status, for the CLI's bar and --events)."""
        left = (total - done) / rate if rate and done < total else 0.0
        alive = len(self.alive)
        self.ctx.on_progress(dtype, done, total)
        self.ctx.on_status(
            dtype,
            {
                "done": done,
                "total": total,
                "unit": unit,
                "per_s": rate,
                "seconds_left": left,
                "workers_alive": alive,
                "workers": len(self.workers),
            },
        )
        self.ctx.emit(
            "batch",
            dtype,
            f"{what} done: {done:,} of {total:,} {unit}, {rate:,.0f} {unit}/s"
            + (f", {words_left(left)}" if left else "")
            + f"; {alive} of {len(self.workers)} Ray workers alive",
        )

    def call(self, target: str, *args: Any, dtype: str | None = None, what: str = "") -> Any:
        """target(prepared, *args) on one live worker (the floor, the routing): on the next if it dies."""
        dead = self._dead_errors()
        for w in self.alive:
            try:
                return self._ray.get(w.handle.run.remote(target, *args))
            except dead as e:
                self._lost(w, e, dtype, what or "the work")
            except self._ray.exceptions.RayTaskError as e:
                raise self._failed(e, w) from e
        raise EngineError(f"every Ray worker stopped before {what or 'the work'} was done: run the same command again")


def _env_for_workers() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}


@contextmanager
def open_cluster(options: Any, prepared: Any) -> Iterator[Cluster]:
    """Workers for this request on the cluster `options` names, each checked before any work starts:
    a cluster without the GPUs the engines need, or an address that does not answer, fails in words.
    Ray started here is stopped on the way out; workers are always released."""
    options = RayOptions.of(options)
    ray = _import_ray()
    ctx, device = prepared.ctx, prepared.device
    where = "a Ray instance on this machine" if options.address == "local" else f"the Ray cluster at {options.address}"
    ctx.emit("ray", None, f"connecting to {where}")
    started = _connect(ray, options.address)
    workers: list[_Worker] = []
    try:
        res = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        on_gpu = device.startswith("cuda")
        # the engine plan's GPUs: a model split by tensor or pipeline parallelism takes that many cards
        settings = prepared.spec.settings
        plan = (settings.tensor_parallel_size or 1) * (settings.pipeline_parallel_size or 1)
        gpus = options.gpus_per_worker if options.gpus_per_worker is not None else (float(plan) if on_gpu else 0.0)
        have_gpu, have_cpu = float(res.get("GPU", 0)), float(res.get("CPU", 0))
        if on_gpu and have_gpu < max(gpus, 1e-9):
            raise UserError(
                f"the engines run on a GPU ({device}) but {where} has no GPU: its {len(nodes)} node(s) offer "
                f"{have_cpu:g} CPU(s) and no GPU. Add GPU nodes, or run with --device cpu"
            )
        if options.workers is not None:
            n = options.workers
        elif gpus:
            n = int(have_gpu // gpus + 1e-9)
        else:
            n = len(nodes)
        n = min(n, int(have_cpu // options.cpus_per_worker)) if options.cpus_per_worker else n
        if n < 1:
            raise UserError(f"{where} has no room for one worker of {options.cpus_per_worker:g} CPU(s) and {gpus:g} GPU(s)")
        per_worker = f"{options.cpus_per_worker:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
        actor = ray.remote(EngineWorker).options(
            num_cpus=options.cpus_per_worker,
            num_gpus=gpus,
            max_restarts=0,
            scheduling_strategy="SPREAD",
            runtime_env={"env_vars": _env_for_workers()},
        )
        threads = {k: os.environ.get(k) for k in THREAD_ENV}
        workers = [_Worker(actor.remote(prepared.spec, prepared.model, device, threads), i + 1) for i in range(n)]
        ctx.emit("ray", None, f"starting {n} worker(s) of {per_worker} on {where} ({len(nodes)} node(s))")
        described = [w.handle.describe.remote() for w in workers]
        ready, waiting = ray.wait(described, num_returns=len(described), timeout=START_TIMEOUT_S)
        if waiting:
            raise UserError(
                f"Ray placed {len(ready)} of {n} workers of {per_worker} within {START_TIMEOUT_S:.0f} s on {where}: "
                "ask for fewer (--ray-workers) or smaller ones (--ray-gpus-per-worker)"
            )
        from logprob_parity.env import device_name, versions

        v = versions()
        mine = {"versions": {k: v[k] for k in ("torch", "transformers", "vllm")}, "device": device_name(device)}
        try:
            found = ray.get(described)
        except ray.exceptions.RayError as e:
            lines = [x.strip() for x in str(e).splitlines() if x.strip() and not x.strip().startswith("^")]
            raise EngineError(
                f"a Ray worker could not start on {where}: {lines[-1] if lines else type(e).__name__} "
                "(is logprob-parity installed on every node?)"
            ) from e
        for w, d in zip(workers, found):
            w.where = f"{d['ip']} (node {d['node']})"
            for key in ("versions", "device"):
                if d[key] != mine[key]:
                    raise UserError(
                        f"Ray worker {w.number} on {w.where} has {key} {d[key]} but this driver has {mine[key]}: "
                        "run ids hold both, so every worker must match the driver"
                    )
        cluster = Cluster(ray, ctx, workers, options.address, per_worker)
        ctx.emit("ray", None, f"{cluster.words()}; each starts its own engines with its first batch")
        yield cluster
    finally:
        for w in workers:
            with contextlib.suppress(Exception):  # a worker already gone is what we wanted
                ray.kill(w.handle, no_restart=True)
        if started:
            ray.shutdown()
