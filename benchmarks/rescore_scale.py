"""Logged rollouts at scale on this machine: `rescore` of many sequences, its memory, and a killed run that resumes.

    python benchmarks/rescore_scale.py [--model PATH] [--sequences 20000] [--prompt 8] [--completion 24] [--no-resume]
        [--device cpu] [--dtype float32] [--no-json] [--out FILE]

Writes a JSONL of logged rollouts (random ids in the model's vocabulary, random negative logprobs),
runs `logprob-parity rescore --rollouts FILE` as a user runs it (a child process, real engines) and
reads that process's peak memory from /proc (its own, not its engine hosts'). Then it runs the same
command on an empty store, kills it with SIGKILL once a third of its batches are stored, runs it
once more and reports how many batches came from the store and how long the rest took.
Default model: the tiny test Llama (a real HF and vLLM pair with a 512-entry vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks.prompt_set import report, rss_peak  # noqa: E402 - importable once the repo is on the path
from logprob_parity.env import device_name  # noqa: E402


def _run(
    cmd: list[str], env: dict[str, str], kill_after_parts: int | None = None, partial: Path | None = None
) -> tuple[int, str, float, int]:
    """(exit code, stderr, seconds, peak RSS bytes); with kill_after_parts, SIGKILL once that many parts exist."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    peak = [0]
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while proc.poll() is None:
        peak[0] = max(peak[0], rss_peak(proc.pid))
        if kill_after_parts and partial is not None and len(list(partial.glob("*/part-*.arrow"))) >= kill_after_parts:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(10)
    return proc.returncode, "".join(err), time.perf_counter() - t, peak[0]


def scale_args(ap: argparse.ArgumentParser) -> None:
    """The options of a logged set's size (this benchmark and rescore_profile.py)."""
    ap.add_argument("--model", default=None, help="default: the tiny test Llama (tests/builders.py)")
    ap.add_argument("--sequences", type=int, default=20_000)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens a sequence")
    ap.add_argument("--completion", type=int, default=24, help="completion tokens a sequence")
    ap.add_argument("--out", default=None)


def logged_lines(a: argparse.Namespace) -> Iterator[str]:
    """The logged set as JSONL lines: random ids in the model's vocabulary (a.model, the tiny test
    Llama when not given: set on `a`), random negative logprobs, the same for the same options."""
    import numpy as np

    if a.model is None:
        from builders import build_tiny_llama

        a.model = str(build_tiny_llama("tiny-llama-bos", adds_bos=True))
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    for i in range(a.sequences):
        yield (
            json.dumps(
                {
                    "prompt_token_ids": [0, *rng.integers(40, vocab, a.prompt - 1).tolist()],
                    "completion_token_ids": rng.integers(40, vocab, a.completion).tolist(),
                    "logprobs": np.round(-rng.random(a.completion) * 4, 6).tolist(),
                    "id": f"r{i}",
                }
            )
            + "\n"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    scale_args(ap)
    ap.add_argument("--no-resume", action="store_true", help="leave out the killed-and-resumed part")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-json", action="store_true", help="leave out --json (a GPU load of millions of tokens writes gigabytes)")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lpp-rescore-scale-"))
    path = home / "logged.jsonl"
    with path.open("w") as f:
        f.writelines(logged_lines(a))
    env = dict(
        os.environ,
        LOGPROB_PARITY_HOME=str(home / "store"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.cli",
        "rescore",
        "--rollouts",
        str(path),
        "--model",
        a.model,
        "--dtype",
        a.dtype,
        "--device",
        a.device,
        *([] if a.no_json else ["--json", str(home / "out.json")]),
    ]
    where = "this CPU" if a.device == "cpu" else f"{device_name(a.device)} ({a.dtype})"
    rows: list[tuple[str, str]] = []
    tokens = a.sequences * a.completion
    rc, err, took, peak = _run(cmd, env)
    if rc != 0:
        raise SystemExit(f"rescore failed ({rc}):\n{err[-3000:]}")
    lines = [ln for ln in err.splitlines() if " done: " in ln]
    n_batches = int(re.search(r"of (\d+) done", lines[-1]).group(1)) if lines else 1  # type: ignore[union-attr]
    rows.append(
        (
            f"rescore {a.sequences:,} logged sequences ({a.prompt} + {a.completion} tokens, {tokens:,} completion tokens), "
            "whole process",
            f"{took:.0f} s, engines' start included; {n_batches} batches",
        )
    )
    rows.append(("peak memory of the CLI process (its engine hosts are processes of their own)", f"{peak / 2**30:.2f} GB"))
    rows.append(("the last progress line", lines[-1].strip() if lines else "-"))
    if not a.no_json:
        rows.append(("--json", f"{(home / 'out.json').stat().st_size / 2**20:.0f} MiB"))
    if a.no_resume:
        report(f"{a.sequences:,} logged rollouts rescored on {where}", a.model, rows, a.out)
        return
    env2 = dict(env, LOGPROB_PARITY_HOME=str(home / "store2"))  # a store without the finished rescore
    partial = home / "store2" / "partial"
    third = max(1, n_batches // 3)
    rc, err, took, _ = _run(cmd, env2, kill_after_parts=third, partial=partial)
    stored = len(list(partial.glob("*/part-*.arrow")))
    rows.append(
        ("the same in an empty store, killed with SIGKILL", f"after {took:.0f} s, {stored} of {n_batches} batches stored")
    )
    rc, err, took, _ = _run(cmd, env2)
    said = next((ln.strip() for ln in err.splitlines() if "came from the store" in ln), "-")
    rows.append(("the same command again", f"{took:.0f} s (exit {rc}); it said: {said}"))
    report(f"{a.sequences:,} logged rollouts rescored on {where}", a.model, rows, a.out)


if __name__ == "__main__":
    main()
