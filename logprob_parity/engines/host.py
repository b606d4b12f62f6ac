"""Engine hosts: each backend runs in its own process, started with `python -m logprob_parity.engines.host`.

Why a subprocess and not multiprocessing: vLLM spawns its own engine process, and multiprocessing's
spawn re-runs a Streamlit script in the child. The host listens on a Unix socket in a private
temp folder, with a random authkey handed over in the environment; only our own client connects.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from logprob_parity.engines.records import HostReply, HostRequest, LoadRequest
from logprob_parity.engines.zygote import FORKED_ENV, ZYGOTE_ENV
from logprob_parity.errors import EngineError, ProtocolError, UserError

ADDRESS_ENV = "LPP_WORKER_ADDRESS"
AUTHKEY_ENV = "LPP_WORKER_AUTHKEY"
PARENT_ENV = "LPP_HOST_PARENT"  # the pid that started the host; it exits when re-parented
LOG_TAIL_CHARS = 2000
# The backend methods a host answers (logprob_parity.engines.backends.base): score and generate on every
# backend; sample (vLLM) and rollout_score (HF) for rollouts; write_full (HF) for the frontier.
# share_rows and release_rows (vLLM) hand the exact KL's full rows to the HF host (logprob_parity.engines.fullvocab);
# bare_prefill (vLLM) and bare_forward (HF) time each engine's plain call, the benchmarks' yardstick.
BACKEND_OPS = (
    "score",
    "generate",
    "sample",
    "rollout_score",
    "score_packed",
    "routes",
    "replay_score",
    "write_full",
    "share_rows",
    "release_rows",
    "bare_prefill",
    "bare_forward",
    "layers",  # the layer part (logprob_parity.engines.layers): a capture kept and shared,
    "layer_errors",  # compared where HF's vectors are,
    "release_layers",  # and freed
    "perturb",  # a planted fault (tests): one block's weights of one layer scaled, until "restore"
    "restore",
    "sleep",  # engines in turn: leave the device, the model kept in host memory,
    "wake",  # and take it again
)
# Seconds an engine may take to load before it is stopped (vLLM: imports, weights, KV cache, warm-up).
LOAD_TIMEOUT_ENV = "LPP_ENGINE_START_TIMEOUT"
# A file to append one JSON line to for every engine load (what, how long, in which process and test):
# the test suite counts its engine starts from it, and a slow dashboard can be traced to its starts.
START_LOG_ENV = "LPP_ENGINE_START_LOG"
# Root causes vLLM's engine core logs but does not raise to the caller, as (pattern, message).
_LOG_CAUSES = (
    (
        re.compile(
            r"(out of memory|less than requested memory|No available memory for the cache blocks|"
            r"Reduce CPU memory|insufficient memory|Cannot allocate memory)",
            re.I,
        ),
        "out of memory while starting the engine; lower gpu_memory_utilization, use a smaller model or free memory",
    ),
    (
        re.compile(r"Model architectures? \[[^\]]*\] (?:are|is) not supported", re.I),
        "vLLM does not support this model's architecture",
    ),
    (
        re.compile(r"trust_remote_code=True", re.I),
        "this model needs custom code: turn on trust_remote_code only if you trust its authors",
    ),
)


# The last measured start of each backend on each kind of device in this process (imports and
# load, seconds), so waiting messages say what a start takes here rather than a guess. Only a start
# that paid the imports counts: a spare's or a swap's load is shorter than a new process's (and the
# fake backend's, which loads nothing, never counts).
LAST_START: dict[tuple[str, str], float] = {}
TYPICAL_START = {"cpu": "about 20-60 s", "cuda": "about 30-90 s"}


def start_words(backend: str, device: str) -> str:
    """What starting this engine takes on this machine, in words: the last start measured here, or
    the usual range for the kind of device."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    last = LAST_START.get((backend, kind))
    where = "this GPU" if kind == "cuda" else "this CPU"
    if last is not None:
        return f"the last {backend} start on {where} took {last:.0f} s"
    return f"on a {'GPU' if kind == 'cuda' else 'CPU'} {TYPICAL_START[kind]}"


def _describe_error(exc: BaseException) -> tuple[str, str]:
    """(kind, message) for errors a user can act on; everything else is an engine error."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "out of memory" in low or type(exc).__name__ == "OutOfMemoryError":
        return "user", f"out of memory while loading or running the engine: {text[:300]}"
    if "trust_remote_code" in low:
        return "user", "this model needs custom code: turn on trust_remote_code only if you trust its authors"
    if "not supported" in low and "architecture" in low:
        m = re.search(r"Model architectures? \[[^\]]*\] (?:are|is) not supported[^.]*", text)
        return "user", f"vLLM does not support this model's architecture ({m.group(0) if m else text[:300]})"
    if isinstance(exc, UserError):
        return "user", str(exc)
    return "engine", text


def _exit_with_parent(parent: int, forked: bool = False) -> None:
    """A host must not outlive the process that started it (a killed dashboard, a crashed test):
    when it is re-parented, it ends its whole process group, vLLM's own children included. A host
    forked by the zygote (logprob_parity.engines.zygote) has the zygote as its parent: it watches the
    process whose pool asked for it instead."""

    def gone() -> bool:
        if not forked:
            return os.getppid() != parent
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if gone():
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="lpp-parent-watch", daemon=True).start()


def _log_start(request: LoadRequest, timing: dict[str, Any], wall_s: float, spare: bool, fork: str | None = None) -> None:
    """One line in LPP_ENGINE_START_LOG (when set) for this load."""
    path = os.environ.get(START_LOG_ENV)
    if not path:
        return
    import json

    line = {
        "backend": request.backend,
        "model": Path(request.model_path).name,
        "dtype": request.dtype,
        "key": request.key(),
        "wall_s": round(wall_s, 2),
        **timing,
        "spare": spare,
        "forked": bool(timing.get("forked")),
        **({"fork_refused": fork} if fork else {}),
        "pid": os.getpid(),  # the process whose pool asked for it (a test run, a CLI, a dashboard)
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
    }
    with contextlib.suppress(OSError), open(path, "a") as f:  # O_APPEND: whole lines from many processes
        f.write(json.dumps(line) + "\n")


def _unload(backend: Any) -> None:
    """Free a loaded model so that this process can load the next one (a swap): the backend's own
    close (vLLM: its engine core and its process-wide distributed state), then the memory."""
    import gc

    backend.close()
    del backend
    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def serve() -> None:
    """Host loop: load the backend named in the first request, then answer score/generate requests.
    A later load request swaps the model: the process, and the seconds its imports took, stay."""
    address = os.environ[ADDRESS_ENV]
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    parent = int(os.environ.get(PARENT_ENV, "0"))
    forked = os.environ.get(FORKED_ENV) == "1"  # imports inherited from the zygote
    if parent and (parent == os.getppid() or forked):
        _exit_with_parent(parent, forked)
    with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        conn = listener.accept()
    backend = None
    try:
        while True:
            try:
                msg: HostRequest = conn.recv()
            except EOFError:
                return
            op = msg.op
            if op == "close":
                return
            try:
                if op == "prepare":  # a spare: pay the imports now, load whichever model comes later
                    from logprob_parity.engines.backends.base import load_backend_class

                    t0 = time.monotonic()
                    load_backend_class(msg.args[0])
                    conn.send(HostReply(True, {"import_s": round(time.monotonic() - t0, 2)}))
                elif op == "load" and msg.load is not None:
                    from logprob_parity.engines.backends.base import load_backend_class

                    t0 = time.monotonic()
                    swapped = backend is not None
                    if swapped:  # a model swap: the imports stay, the old model goes first
                        _unload(backend)
                        backend = None
                    t1 = time.monotonic()
                    cls = load_backend_class(msg.load.backend)
                    t2 = time.monotonic()
                    backend = cls(**msg.load.backend_kwargs())
                    timing = {"import_s": round(t2 - t1, 2), "init_s": round(time.monotonic() - t2, 2)}
                    if swapped:
                        timing |= {"swapped": True, "unload_s": round(t1 - t0, 2)}
                    if forked:
                        timing["forked"] = True
                    conn.send(HostReply(True, {**backend.info(), "load_timing": timing}))
                elif op in BACKEND_OPS and backend is not None and hasattr(backend, op):
                    conn.send(HostReply(True, getattr(backend, op)(*msg.args)))
                elif op in BACKEND_OPS and backend is not None:
                    conn.send(HostReply(False, kind="user", text=f"the {backend.name} backend cannot {op}"))
                elif op in BACKEND_OPS:
                    conn.send(HostReply(False, kind="protocol", text=f"{op} request before the engine loaded"))
                else:
                    conn.send(HostReply(False, kind="protocol", text=f"unknown request {op!r}"))
            except BaseException as exc:  # report everything; the client decides
                kind, text = _describe_error(exc)
                traceback.print_exc()
                conn.send(HostReply(False, kind=kind, text=text))
                if op == "load":
                    return
    finally:
        if backend is not None:
            backend.close()
        conn.close()


def host_env(extra_env: dict[str, str]) -> dict[str, str]:
    """The environment of a host started now with `extra_env`, less its own address, key and parent."""
    env = dict(os.environ, **extra_env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's engine core in this host process, not a second one: one import of torch and vLLM
    # instead of two, which halves the start and the CPU that engines starting side by side share.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds the package
    paths = [root, *(env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def env_print(extra_env: dict[str, str]) -> int:
    """The environment a host started now with `extra_env` would have (less the test name, which
    changes per test): a spare or a swap serves only an engine its process was started for."""
    env = dict(os.environ, **extra_env)
    env.pop("PYTEST_CURRENT_TEST", None)
    return hash(tuple(sorted(env.items())))


class HostClient:
    """One engine host process, seen from the pool. `start()` returns at once; `load()` waits for the model.

    `leases` counts the requests that hold or were promised this host: the pool never stops a host
    whose count is above zero."""

    def __init__(self, label: str, extra_env: dict[str, str] | None = None, device: str = "cpu", need_bytes: int = 0) -> None:
        self.label = label
        self.extra_env = extra_env or {}
        self.device = device
        self.need_bytes = need_bytes  # what the pool expects it to take on its device
        self.turn_seconds = {"sleep": 0.0, "wake": 0.0}  # spent leaving and taking the device (engines in turn)
        self.busy = False  # a request is in flight
        self.leases = 0  # requests holding or promised this host (logprob_parity.engines.pool)
        self.owners: dict[int, int] = {}  # thread id -> leases it holds
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.info: dict[str, Any] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="lpp-host-"))
        os.chmod(self._dir, 0o700)
        self.address = str(self._dir / "sock")
        self.log_path = self._dir / "host.log"
        self._authkey = secrets.token_bytes(32)
        self.last_used = time.monotonic()
        self.request: LoadRequest | None = None  # the model it holds or is loading
        self.prepared: str | None = None  # a spare: the backend it imported before any model came
        self._preparer: threading.Thread | None = None
        self.env_print = 0  # env_print of the environment it was started with
        self.loads = 0  # models loaded in this process
        self.swaps = 0  # of which loaded in place of another model
        self.refused_fork: str | None = None  # why the zygote did not fork this host, where one was asked
        self.asleep = False  # its model left the device for host memory (engines in turn); `wake` brings it back
        self.slept = False  # it has slept: its host memory for the weights is taken (torch keeps the pinned blocks after a wake)
        self._began = threading.Event()  # set once begin_load has sent a load (wait_loaded waits for it)

    def start(self, spare: bool = False) -> HostClient:
        """Start the host process. spare: it is started as a spare (`prepare` follows), and says so in
        its command line (`--spare`), where a person or a test looking at the processes sees it.
        Where this process has an engine zygote (logprob_parity.engines.zygote), the host is forked
        from it, imports done, unless its environment or device rule that out."""
        self.env_print = env_print(self.extra_env)
        env = host_env(self.extra_env)
        env[ADDRESS_ENV] = self.address
        env[AUTHKEY_ENV] = self._authkey.hex()
        env[PARENT_ENV] = str(os.getpid())
        if os.environ.get(ZYGOTE_ENV) and not spare:
            from logprob_parity.engines.zygote import fork_host

            forked = fork_host(env, self.log_path, self.device)
            if not isinstance(forked, str):
                self.proc = forked  # type: ignore[assignment]
                return self
            self.refused_fork = forked
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "logprob_parity.engines.host", *(["--spare"] if spare else [])],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # our Ctrl-C is handled by us, then we stop it cleanly
            )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _died(self, doing: str) -> EngineError:
        code = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the socket closes a moment before the exit status
                code = self.proc.wait(timeout=5)
        how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code}" if code else "no answer"
        return EngineError(f"{self.label} engine host died while {doing} ({how}). Last log lines:\n{self.log_tail()}")

    def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.conn is None:
            if not self.alive():
                raise self._died("starting")
            if os.path.exists(self.address):
                try:
                    self.conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
                    return
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"{self.label} engine did not start within {timeout:.0f} s ({LOAD_TIMEOUT_ENV}); stopped it")
            time.sleep(0.05)

    def _request(self, msg: HostRequest, doing: str, timeout: float) -> Any:
        if self.conn is None:
            raise ProtocolError(f"{self.label} host is not connected (stopped, or never started) while {doing}")
        self.busy = True
        try:
            self.conn.send(msg)
            deadline = time.monotonic() + timeout
            while not self.conn.poll(0.2):
                if not self.alive():
                    raise self._died(doing)
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineError(f"{self.label} engine host took longer than {timeout:.0f} s {doing}; stopped it")
            reply = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise self._died(doing) from exc
        finally:
            self.busy = False
            self.last_used = time.monotonic()
        if reply.ok:
            return reply.value
        kind, text = reply.kind, reply.text
        if kind == "protocol":
            raise ProtocolError(f"{self.label}: {text}")
        if kind == "user":
            raise UserError(f"{self.label}: {text}")
        cause = self.root_cause()
        if cause:
            raise UserError(f"{self.label}: {cause}")
        raise EngineError(f"{self.label}: {text}\n{self.log_tail()}")

    def root_cause(self) -> str | None:
        """A cause the user can act on, found in the host's log (vLLM logs its engine core's errors)."""
        log = self.log_tail(200_000)
        for pattern, message in _LOG_CAUSES:
            m = pattern.search(log)
            if m:
                line = next((ln for ln in log.splitlines() if m.group(0) in ln), m.group(0))
                line = line.split(" Supported architectures:")[0]  # vLLM then lists its hundreds of architectures
                return f"{message} ({line.strip()[-300:]})"
        return None

    def prepare(self, backend: str) -> HostClient:
        """Make this (started, empty) host a spare: it imports `backend`'s engine now, in the background,
        and loads a model only when `begin_load` names one (logprob_parity.engines.pool)."""

        def run() -> None:
            with contextlib.suppress(BaseException):  # a spare that failed is found dead, or fails its load
                self._connect(timeout=float(os.environ.get(LOAD_TIMEOUT_ENV, "900")))
                self._request(HostRequest("prepare", (backend,)), f"importing {backend}", 900.0)

        self.prepared = backend
        self._preparer = threading.Thread(target=run, name=f"prepare {backend}", daemon=True)
        self._preparer.start()
        return self

    def begin_load(self, request: LoadRequest) -> None:
        """Send the load request from a thread and return at once: engines started together import
        and load side by side; `wait_loaded` collects the answer. On a host that holds a model, the
        load swaps it for this one in the same process."""
        preparing = self._preparer

        def run() -> None:
            try:
                if preparing is not None:  # one request at a time on the connection
                    preparing.join()
                self.load(request)
            except BaseException as exc:  # handed to whoever waits for this engine
                self._load_error = exc

        self.request = request
        self.label = request.label
        self.info = None
        self.swaps += self.loads > 0
        self.loads += 1
        self._load_error: BaseException | None = None
        self._loader = threading.Thread(target=run, name=f"load {self.label}", daemon=True)
        self._loader.start()
        self._began.set()

    def expect_load(self, request: LoadRequest) -> None:
        """This host will load `request` once the device is free (the pool puts other engines to sleep
        first): it reads as loading that model now, and `wait_loaded` waits for the load to begin."""
        self.request, self.label, self.info = request, request.label, None
        self._began.clear()

    def expect_wake(self) -> None:
        """This sleeping host will be woken (`finish_wake`): until then it reads as loading, so another
        request that leases it waits in `wait_loaded` until the engine holds the device again."""
        self._asleep_info, self.info = self.info, None
        self._began.clear()

    def finish_wake(self) -> None:
        """`wake`, then the host reads as loaded again (or its waiters get the reason it could not)."""
        try:
            self.wake()
            self.info = self._asleep_info
        except BaseException as exc:
            self._load_error = exc
            raise
        finally:
            self._began.set()

    def wait_loaded(self) -> dict[str, Any]:
        self._began.wait()
        self._loader.join()
        if self._load_error is not None:
            raise self._load_error
        return self.info  # type: ignore[return-value]

    def load(self, request: LoadRequest, timeout: float | None = None) -> dict[str, Any]:
        timeout = timeout if timeout is not None else float(os.environ.get(LOAD_TIMEOUT_ENV, "900"))
        start = time.monotonic()
        self._connect(timeout=timeout)
        left = max(timeout - (time.monotonic() - start), 1.0)
        try:
            self.info = self._request(HostRequest("load", load=request), "loading the model", left)
        except (UserError, EngineError) as exc:  # name the family: "vllm (float32) cannot run the codegen family ..."
            from logprob_parity.inputs.models import family_of

            family = family_of(request.model_path)
            if not family:
                raise
            text = str(exc).removeprefix(f"{self.label}: ")
            raise type(exc)(f"{self.label} cannot run the {family} family: {text}") from None

        t = (self.info or {}).get("load_timing") or {}
        spare = self.prepared is not None and self.loads == 1
        real = (self.info or {}).get("backend") != "fake"  # the plumbing tests' stand-in loads no model
        cold = t and real and not spare and not t.get("swapped") and not t.get("forked")
        if cold:  # a new process that paid the imports: what an estimate of the next start reads
            kind = "cuda" if request.device.startswith("cuda") else "cpu"
            LAST_START[(request.backend, kind)] = float(t.get("import_s", 0)) + float(t.get("init_s", 0))
        _log_start(request, t, time.monotonic() - start, spare=spare, fork=self.refused_fork)
        return self.info

    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: Any = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: Any = None,
        timeout: float = 3600.0,
    ) -> Any:
        return self._request(
            HostRequest("score", (sequences, top_k, gather_ids, batch_size, padding_side, full)), "scoring", timeout
        )

    def generate(self, sequences: list[list[int]], max_new_tokens: int, timeout: float = 3600.0) -> list[list[int]]:
        return self._request(HostRequest("generate", (sequences, max_new_tokens)), "generating", timeout)

    def sample(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        sampling: dict[str, Any],
        modes: tuple[str, ...],
        timeout: float = 3600.0,
    ) -> list[dict[str, Any]]:
        return self._request(HostRequest("sample", (prompts, seeds, sampling, modes)), "sampling", timeout)

    def rollout_score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        chunk: int | None = None,
        full: Any = None,
        tail: int | None = None,
        timeout: float = 3600.0,
    ) -> list[dict[str, Any]]:
        return self._request(
            HostRequest("rollout_score", (sequences, starts, temperature, top_k, top_p, chunk, full, tail)),
            "scoring the rollout",
            timeout,
        )

    def score_packed(self, sequences: list[list[int]], row_positions: int, timeout: float = 3600.0) -> Any:
        return self._request(HostRequest("score_packed", (sequences, row_positions)), "scoring packed rows", timeout)

    def routes(self, sequences: list[list[int]], timeout: float = 3600.0) -> Any:
        return self._request(HostRequest("routes", (sequences,)), "reading the experts each token was routed to", timeout)

    def replay_score(self, sequences: list[list[int]], routes: list[Any], timeout: float = 3600.0) -> Any:
        return self._request(HostRequest("replay_score", (sequences, routes)), "scoring with the experts replayed", timeout)

    def layers(self, ids: list[int], variation: str = "alone", others: Any = None, timeout: float = 3600.0) -> Any:
        return self._request(HostRequest("layers", (ids, variation, others)), "capturing every layer", timeout)

    def layer_errors(self, ids: list[int], other: dict[str, Any], others: Any = None, timeout: float = 3600.0) -> Any:
        return self._request(HostRequest("layer_errors", (ids, other, others)), "comparing every layer", timeout)

    def release_layers(self, token: str, timeout: float = 600.0) -> Any:
        return self._request(HostRequest("release_layers", (token,)), "freeing the layer capture", timeout)

    def share_rows(self, token: str, timeout: float = 600.0) -> dict[str, Any]:
        return self._request(HostRequest("share_rows", (token,)), "sharing full logprobs", timeout)

    def release_rows(self, token: str, timeout: float = 600.0) -> None:
        return self._request(HostRequest("release_rows", (token,)), "freeing full logprobs", timeout)

    def call(self, op: str, *args: Any, timeout: float = 3600.0) -> Any:
        """Any backend op by name (BACKEND_OPS), e.g. the benchmarks' bare_prefill and bare_forward."""
        return self._request(HostRequest(op, args), op.replace("_", " "), timeout)

    def sleep(self, timeout: float = 1800.0) -> bool:
        """The engine leaves the device, its model kept in host memory; False: it cannot."""
        t = time.perf_counter()
        try:
            went = bool(self._request(HostRequest("sleep"), "leaving the device (engines in turn)", timeout))
            self.slept = self.slept or went
            return went
        finally:
            self.turn_seconds["sleep"] += time.perf_counter() - t

    def wake(self, timeout: float = 1800.0) -> None:
        t = time.perf_counter()
        try:
            self._request(HostRequest("wake"), "taking the device again (engines in turn)", timeout)
        finally:
            self.turn_seconds["wake"] += time.perf_counter() - t

    def write_full(self, sequences: list[list[int]], folder: str, timeout: float = 3600.0) -> int:
        return self._request(HostRequest("write_full", (sequences, folder)), "writing full logprobs", timeout)

    def stop(self, grace: float = 20.0) -> None:
        """Ask the host to exit, then make sure it and its engine processes are gone."""
        if self.conn is not None:
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(HostRequest("close"))
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the whole group: vLLM's engine-core children too
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    serve()
