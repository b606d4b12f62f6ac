"""The zygote's own process (`python -m logprob_parity.engines.zygote_server`): it imports the engines
once, then forks a host for each request that `zygote.fork_host` sends. What a zygote is for, and when
it refuses: `logprob_parity.engines.zygote`. Apart from that module because a forked child becomes a
host (`host.serve`), and the host module asks `zygote` for forks: one module would import the other both ways.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import sys
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from logprob_parity.engines.zygote import EXIT_FILE, FORKED_ENV, PRELOAD, ZYGOTE_ENV, ZYGOTE_KEY_ENV, refusal


def _child(env: dict[str, str], log_path: str) -> None:
    """In the forked child: become a host process as `python -m logprob_parity.engines.host` would be."""
    code = 1
    try:
        os.setsid()  # its own process group, as start_new_session gives an ordinary host
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update(env, **{FORKED_ENV: "1"})
        from logprob_parity.engines import host

        host.serve()
        code = 0
    except BaseException:  # what an ordinary host would print before it exits non-zero
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(folders: dict[int, str]) -> None:
    """Collect every child that ended and write its status where its pool looks (`EXIT_FILE`)."""
    while folders:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        folder = folders.pop(pid, None)
        if folder and os.path.isdir(folder):
            tmp = os.path.join(folder, EXIT_FILE + ".tmp")
            with contextlib.suppress(OSError):
                Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, os.path.join(folder, EXIT_FILE))


def main() -> None:
    """Listen, import the engines, then fork a host for each request until the parent is gone."""
    address = os.environ[ZYGOTE_ENV]
    authkey = bytes.fromhex(os.environ[ZYGOTE_KEY_ENV])
    parent = os.getppid()
    base = dict(os.environ)
    folders: dict[int, str] = {}
    with Listener(address, family="AF_UNIX", authkey=authkey) as listener:  # clients wait while we import
        from logprob_parity.engines.backends.base import load_backend_class

        for name in PRELOAD:
            with contextlib.suppress(Exception):  # a backend that is not installed is imported by its host
                cls = load_backend_class(name)
                # what each of its hosts would do once (vLLM: compile its token ranker), done here once
                getattr(cls, "prefork", lambda: None)()
        after = dict(os.environ)
        sock = listener._listener._socket  # to wait with a timeout, and reap ended hosts between requests
        while os.getppid() == parent:
            _reap(folders)
            if not select.select([sock], [], [], 0.5)[0]:
                continue
            try:
                conn = listener.accept()
            except Exception as exc:  # a client that failed the handshake: say so, serve the next
                print(f"zygote: a client failed to connect ({exc})", flush=True)
                continue
            with conn:
                try:
                    req: dict[str, Any] = conn.recv()
                except (EOFError, OSError):
                    continue
                why = refusal(req["env"], base, after) if req.get("device", "cpu") == "cpu" else "its device is not the CPU"
                if why:
                    conn.send({"refused": why})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # Every object the imports made moves to the collector's permanent generation, so a
                # host's collections never walk them: each walk wrote their headers, copying the pages
                # the host shared with us. Measured on this 2-core CPU with the hf and vllm backends
                # loaded (645,000 objects), two full collections in a forked child took 0.76 s of CPU
                # and 45,318 page faults (186 MB copied); 0.09 s and 3,968 with the freeze
                # (benchmarks/zygote_gc.py).
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    _child(req["env"], req["log_path"])
                folders[pid] = str(Path(req["log_path"]).parent)
                conn.send({"pid": pid})


if __name__ == "__main__":
    main()
