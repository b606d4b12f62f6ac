"""A zygote: one process that imports the engines once, then forks a ready engine host for each start.

Why: a new engine host spends most of its start importing torch, transformers and vLLM (6 to 10 s on a
2-core CPU), and a test session starts about 250 of them, in its own process and in every CLI and
dashboard it runs. A host forked from a process that already holds those imports starts in milliseconds
and runs the same `host.serve()` as a host started by `python -m logprob_parity.engines.host`.

It is opt-in: `LPP_ENGINE_ZYGOTE` (the socket's address) and `LPP_ENGINE_ZYGOTE_KEY` (its authkey, hex) in
a process's environment make that process's pool ask here first. The test session starts one
(`tests/conftest.py`); every process it starts inherits the two variables. The dashboard and the CLI
start hosts the ordinary way unless a person sets them.

A fork is refused, and the host is started the ordinary way, when the environment asked for differs
from the zygote's in a variable that may be read at import time (`refusal`), or when the host's device
is not the CPU: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client
from pathlib import Path

ZYGOTE_ENV = "LPP_ENGINE_ZYGOTE"
ZYGOTE_KEY_ENV = "LPP_ENGINE_ZYGOTE_KEY"
FORKED_ENV = "LPP_HOST_FORKED"  # set in a forked host: the start log and the parent watch read it
EXIT_FILE = "exit"  # written by the zygote, in the host's folder, when it reaps the host: its exit status
# Variables that may differ between the zygote and a host forked from it. The project's own (LPP_...)
# are read when used, but for those in READ_AT_IMPORT; MPLBACKEND is read by matplotlib, which the
# zygote does not import (a forked host imports it with its own); torch's inductor sets
# _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR in the process that compiles, just before it reads it.
# The rest are written at run time by what the asking process ran, and read when used, never at
# import: Ray's connect (`ray.init`) writes PYTHONBREAKPOINT (read by each `breakpoint()`),
# RAY_AUTH_MODE and RAY_USAGE_STATS_ENABLED (read by the next `ray.init`) and RAY_CLIENT_MODE;
# Streamlit's start writes MAPBOX_API_KEY (read by PyDeck's charts). A Ray worker's raylet gives it
# RAY_JOB_ID, RAY_RAYLET_PID and RAY_LD_PRELOAD_ON_WORKERS, read by Ray's own worker code, which an engine
# host does not run (LD_PRELOAD itself, read by the loader at exec, is checked like any other), and
# SPT_NOENV, which setproctitle reads at its first title change, in the host after the fork.
FORK_SAFE = frozenset(
    {
        "RAY_JOB_ID",
        "RAY_RAYLET_PID",
        "RAY_LD_PRELOAD_ON_WORKERS",
        "SPT_NOENV",
        "PYTEST_CURRENT_TEST",
        "LOGPROB_PARITY_HOME",
        "MPLBACKEND",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "RAY_CLIENT_MODE",
        "PYTHONBREAKPOINT",
        "RAY_AUTH_MODE",
        "RAY_USAGE_STATS_ENABLED",
        "MAPBOX_API_KEY",
    }
)
READ_AT_IMPORT = frozenset({"LPP_FULL_KL_MAX_BYTES", "LPP_FULL_KL"})  # logprob_parity.engines.fullvocab
PRELOAD = ("hf", "vllm")  # the backends whose imports every forked host inherits


def _safe(name: str) -> bool:
    return name in FORK_SAFE or (name.startswith("LPP_") and name not in READ_AT_IMPORT)


def refusal(env: dict[str, str], base: dict[str, str], after: dict[str, str]) -> str | None:
    """Why a host with environment `env` must not be forked from a zygote started with `base`, or None.
    A value the zygote had before its imports or has after them is the same: vLLM's import sets a few
    variables (LD_LIBRARY_PATH, TORCHINDUCTOR_CACHE_DIR), and so did the asking process's."""
    unsafe = sorted(k for k in set(env) | set(base) if env.get(k) not in (base.get(k), after.get(k)) and not _safe(k))
    return f"its environment differs in {', '.join(unsafe[:5])}" if unsafe else None


# -- the pool's side -----------------------------------------------------------------------------


class ForkedProcess:
    """A host forked by the zygote, with the parts of `subprocess.Popen` that `HostClient` uses.

    We are not its parent, so its liveness comes from a pidfd and its exit status from the file the
    zygote writes when it reaps it."""

    def __init__(self, pid: int, folder: Path) -> None:
        self.pid = pid
        self.args = ["<forked by the engine zygote>"]
        self.returncode: int | None = None
        self._exit = folder / EXIT_FILE
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # it ended already
            self._fd = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._fd is not None and not select.select([self._fd], [], [], 0)[0]:
            return None
        deadline = time.monotonic() + 2.0  # it ended: the zygote writes its status when it reaps it
        while not self._exit.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self.returncode = int(self._exit.read_text())
        except (OSError, ValueError):  # the zygote is gone and someone else reaped it
            self.returncode = -signal.SIGKILL
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if self._fd is not None:
                left = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                select.select([self._fd], [], [], left)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_host(env: dict[str, str], log_path: Path, device: str) -> ForkedProcess | str:
    """Ask this process's zygote (`LPP_ENGINE_ZYGOTE`) for a host; returns it, or why not."""
    address, key = os.environ.get(ZYGOTE_ENV), os.environ.get(ZYGOTE_KEY_ENV)
    if not address or not key:
        return "no zygote"
    if not os.path.exists(address):
        return "the zygote is gone"
    try:
        with Client(address, family="AF_UNIX", authkey=bytes.fromhex(key)) as conn:
            conn.send({"env": env, "log_path": str(log_path), "device": device})
            if not conn.poll(120.0):
                return "the zygote did not answer"
            reply = conn.recv()
    except (OSError, EOFError, ValueError) as exc:
        return f"the zygote failed ({exc})"
    if "refused" in reply:
        return str(reply["refused"])
    return ForkedProcess(int(reply["pid"]), log_path.parent)


class Zygote:
    """Start a zygote from this process (the test session) and point this process's environment at it,
    so the pools here and in every process started from here fork their hosts from it."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="lpp-zygote-"))
        os.chmod(self._dir, 0o700)
        self.address = str(self._dir / "sock")
        self.log_path = self._dir / "zygote.log"
        self.proc: subprocess.Popen | None = None
        self._before: dict[str, str | None] = {}

    def start(self, env: dict[str, str]) -> Zygote:
        """env: the environment hosts will ask for (`host.host_env`), less their own address and key."""
        key = secrets.token_hex(32)
        env = {**env, ZYGOTE_ENV: self.address, ZYGOTE_KEY_ENV: key}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "logprob_parity.engines.zygote_server"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30.0  # its socket comes before its imports: a client then waits for them
        while not os.path.exists(self.address) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self._before = {k: os.environ.get(k) for k in (ZYGOTE_ENV, ZYGOTE_KEY_ENV)}
        os.environ[ZYGOTE_ENV] = self.address
        os.environ[ZYGOTE_KEY_ENV] = key
        return self

    def stop(self) -> None:
        """Stop it, and point this process back where it pointed before `start` (another zygote, or none)."""
        for name, value in self._before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
