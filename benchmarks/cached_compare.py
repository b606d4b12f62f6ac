"""How long a repeated, identical `compare` takes when the store answers (no engine may start).

    python benchmarks/cached_compare.py [--repeats 5]
Runs the CLI once to fill a fresh store (demo model, ten sentences, float32+bfloat16), then times
the same command N more times. Prints and writes benchmarks/results/cached_compare.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from logprob_parity.paths import store_root  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lpp-bench-"))
    (store_root() / "models").mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(store_root() / "models")
    env = dict(os.environ, LOGPROB_PARITY_HOME=str(home))
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.cli",
        "compare",
        "--prompts",
        str(REPO / "logprob_parity/data/sentences.txt"),
        "--dtype",
        "float32,bfloat16",
        "--quiet",
    ]
    try:
        t = time.perf_counter()
        first = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        cold = time.perf_counter() - t
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - t)
            assert out.stdout.count("no engine started") == 2 and "starting engine" not in out.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = [
        "| what | seconds |",
        "|---|---|",
        f"| first compare (2 dtypes, engines start) | {cold:.1f} |",
        f"| repeated compare from the store, median of {a.repeats} (whole process) | {statistics.median(times):.2f} |",
        f"| repeated compare, max | {max(times):.2f} |",
        f"| ratio first / repeated | {cold / statistics.median(times):.0f}x |",
    ]
    text = "Cached compare, demo model, ten sentences, float32+bfloat16, CPU\n\n" + "\n".join(lines) + "\n\n" + first.stdout
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "cached_compare.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
