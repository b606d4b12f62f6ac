"""Ray's overhead: one process against Ray workers sharing the same device, on the same prompt set.

    python benchmarks/ray_overhead.py [--model PATH] [--prompts 2000] [--words 400] [--workers 2]
        [--gpus-per-worker 0.5] [--device auto] [--dtype bfloat16] [--out FILE]

Issue 31's H200 benchmark: two workers at half the card each against one process, on the 1.1B shape
with 2,000 prompts of about 512 tokens, the exact KL on. The card is shared, so no speed-up is
expected: this measures what Ray costs (target: Ray's positions/s at least 0.9x one process's), and
checks that both give the same run (id, summary). Engine starts are not counted on either side: the
rate is the steady one, from the first finished batch to the last (positions done between them over
the time between them, read from the run's own progress reports); the wall time, starts included,
is beside it. Ray starts here (`--ray` with no address) with as many workers as asked.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "be",
    "were",
    "which",
    "are",
    "this",
    "or",
    "had",
    "not",
]


def texts(n: int, words: int) -> tuple[str, ...]:
    """n distinct prompts of `words` words (about 1.2 tokens a word with a BPE vocabulary)."""
    import random

    rng = random.Random(0)
    return tuple(f"Prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the tiny test Llama")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpus-per-worker", type=float, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import Context
    from logprob_parity.env import resolve_device, versions
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    if a.model is None:
        from builders import build_tiny_llama

        a.model = str(build_tiny_llama("tiny-llama-bos", adds_bos=True))
    device = resolve_device(a.device)
    spec = RunSpec(texts=texts(a.prompts, a.words), model=a.model, dtypes=(a.dtype,), device=device)
    ray = {"address": "local", "workers": a.workers, "gpus_per_worker": a.gpus_per_worker}
    rows = {}
    for name, opts in (("one process", None), (f"Ray, {a.workers} workers", ray)):
        home = Path(tempfile.mkdtemp(prefix="lpp-ray-bench-"))
        ticks: list[tuple[float, int]] = []
        t = time.perf_counter()
        ctx = Context.of(
            store=Store(home), ray=opts, on_status=lambda d, x, ticks=ticks: ticks.append((time.perf_counter(), x["done"]))
        )
        (run,) = compare(spec, ctx, use_cache=False)
        wall = time.perf_counter() - t
        positions = sum(len(s.token_ids) - 1 for s in run.sequences)
        (t0, d0), (t1, d1) = ticks[0], ticks[-1]
        steady = (d1 - d0) / (t1 - t0) if t1 > t0 else float("nan")
        rows[name] = (run, wall, positions, steady)
        print(f"{name}: {positions:,} positions in {wall:.1f} s (starts included); steady {steady:,.0f} positions/s", flush=True)
    (a_run, _, n, a_rate), (b_run, _, _, b_rate) = rows.values()
    same = a_run.run_id == b_run.run_id and a_run.summary == b_run.summary
    v = versions()
    lines = [
        f"# Ray overhead ({device}, {a.dtype}, {a.prompts} prompts, {n:,} positions, exact KL)",
        "",
        f"model {a.model}; vLLM {v['vllm']}, transformers {v['transformers']}, torch {v['torch']}; "
        f"Ray workers {a.workers} x {a.gpus_per_worker if a.gpus_per_worker is not None else 'default'} GPU",
        "",
        "| run | wall s (engine starts included) | steady positions/s (first batch to last) |",
        "|---|---|---|",
        *(f"| {k} | {w:.1f} | {r:,.0f} |" for k, (_, w, _, r) in rows.items()),
        "",
        f"Ray / one process, steady: {b_rate / a_rate:.2f}x (target at least 0.9x); same run id and summary: {same}",
    ]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    os._exit(0 if same else 1)


if __name__ == "__main__":
    main()
