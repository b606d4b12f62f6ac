"""A prompt set of 10,000 on this machine: memory bounded by the batch, progress, and the Prompt set page's reads.

    python benchmarks/prompt_set.py [--model PATH] [--prompts 10000] [--dtype float32] [--out FILE]

Runs `logprob-parity compare --prompts FILE` as the CLI runs it (a child process, real engines), and
reads that process's peak memory (its own, not its engine hosts': they are processes of their own)
from /proc as it runs. Then, in this process, what the Prompt set page does with the stored run:
open it, build the per-prompt table from its summaries, and open one prompt (its tokens, the token
view and the worst tokens over every prompt). Default model: the tiny test Llama (a real HF and
vLLM engine pair with a 512-entry vocabulary, so 10,000 prompts take minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def rss_peak(pid: int) -> int:
    """VmHWM of a process, bytes (its peak resident memory so far)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the tiny test Llama (tests/builders.py)")
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lpp-set-"))
    if a.model is None:
        from builders import build_tiny_llama

        a.model = str(build_tiny_llama("tiny-llama-bos", adds_bos=True))
    lines = (REPO / "logprob_parity" / "data" / "sentences.txt").read_text().splitlines()
    words = " ".join(lines).split()
    prompts = [" ".join(words[(i * 7) % (len(words) - 40) :][: 4 + i % 12]) + f" ({i})" for i in range(a.prompts)]
    pfile = home / "set.txt"
    pfile.write_text("\n".join(prompts) + "\n")
    env = dict(
        os.environ,
        LOGPROB_PARITY_HOME=str(home / "store"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.cli",
        "compare",
        "--model",
        a.model,
        "--prompts",
        str(pfile),
        "--dtype",
        a.dtype,
        "--device",
        "cpu",
        "--json",
        str(home / "out.json"),
    ]
    rows: list[tuple[str, str]] = []
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], rss_peak(proc.pid))
            time.sleep(0.5)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    _out, err = proc.communicate()
    took = time.perf_counter() - t
    w.join()
    if proc.returncode != 0:
        raise SystemExit(f"compare failed ({proc.returncode}):\n{err[-3000:]}")
    batches = [ln for ln in err.splitlines() if "batch " in ln and " done: " in ln]
    rows.append(
        (
            f"compare --prompts ({a.prompts:,} prompts, {a.dtype}, the exact KL, its noise floor), whole process",
            f"{took:.0f} s, engines' start included",
        )
    )
    rows.append(
        (
            "peak memory of the CLI process (its engine hosts are processes of their own)",
            f"{peak[0] / 2**30:.2f} GB (target <= 2 GB)",
        )
    )
    rows.append(
        (
            "progress lines it printed (one a batch, with tokens/s and time left)",
            f"{len(batches)}; the last: {batches[-1].strip() if batches else '-'}",
        )
    )
    rows.append(("--json written a sequence at a time", f"{(home / 'out.json').stat().st_size / 2**20:.0f} MiB"))

    os.environ["LOGPROB_PARITY_HOME"] = str(home / "store")
    from logprob_parity.present.charts import worst_tokens
    from logprob_parity.present.render import token_view_html
    from logprob_parity.results.store import Store

    store = Store(home / "store")
    run_id = store.list_runs()["run_id"].iloc[0]
    t = time.perf_counter()
    run = store.load(run_id)
    rows.append(
        (
            "open the stored run (checksum, metadata)",
            f"{time.perf_counter() - t:.2f} s; {len(run.meta.sequences):,} prompts, {run.summary['n_tokens']:,} tokens",
        )
    )
    t = time.perf_counter()
    table = [(i, s.text[:120], s.summary["n_tokens"], s.summary["max_abs_delta"]) for i, s in enumerate(run.meta.sequences)]
    table.sort(key=lambda r: -(r[3] or 0))
    rows.append(("the Prompt set page's table, the largest gap first", f"{time.perf_counter() - t:.2f} s"))
    t = time.perf_counter()
    seq = run.sequences[table[0][0]]
    html = token_view_html([run], table[0][0])
    rows.append(
        (
            "open one prompt: its positions and token view",
            f"{time.perf_counter() - t:.2f} s ({len(seq.token_ids)} tokens, {len(html) / 1e3:.0f} kB of HTML; target < 2 s)",
        )
    )
    t = time.perf_counter()
    worst_tokens([run], 20)
    rows.append(("the worst 20 tokens over every prompt", f"{time.perf_counter() - t:.2f} s"))
    report(f"A prompt set of {a.prompts:,} on this CPU", a.model, rows, a.out)


def report(title: str, model: str, rows: list[tuple[str, str]], out: str | None) -> None:
    """The results table of a CPU-scale benchmark, headed by the machine, versions, model and the
    command line; printed, and written to `out` when given."""
    from logprob_parity.env import versions

    v = versions()
    text = (
        "\n".join(
            [
                f"# {title}",
                "",
                f"{os.cpu_count()} CPU cores · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
                f"model {Path(model).name} · `python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
                "",
                "| measurement | result |",
                "|---|---|",
                *[f"| {k} | {x} |" for k, x in rows],
            ]
        )
        + "\n"
    )
    print(text)
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
