"""The Rollout and Frontier pages' default runs, timed as a demo meets them: engines warmed as the
dashboard server warms them (logprob_parity.analysis.prewarm), then each page's defaults
(logprob_parity.analysis.estimate) run twice. Target (issue 34: a live demo with no traps): each
default run finishes in under 60 s on warm engines on this project's 2-core CPU.

It also measures the rates the forms' time estimates use when this server has not run anything yet
(estimate.MEASURED): a sampled token's work, a sampled token's share of the noise floors, and a
frontier configuration's work once its engine is warm.

    python benchmarks/page_defaults.py [--out benchmarks/results/page_defaults_cpu.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "page_defaults_cpu.md"))
    args = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-page-defaults-"))

    from logprob_parity.analysis.estimate import frontier_defaults, rollout_defaults
    from logprob_parity.analysis.frontier import default_grid, frontier
    from logprob_parity.analysis.prewarm import warm_defaults
    from logprob_parity.analysis.request import Context
    from logprob_parity.analysis.rollout import NOISE_SAMPLES, rollout
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.prompts import SEED_TEXT
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import Sampling

    device = resolve_device("auto")
    ctx = Context.of()
    lines = [
        f"# The pages' default runs ({device_name(device)}, {os.cpu_count()} cores)",
        "",
        f"`python benchmarks/page_defaults.py`; vLLM {versions()['vllm']}, torch {versions()['torch']}, "
        f"transformers {versions()['transformers']}; the demo model.",
        "",
        "| what | seconds | note |",
        "|---|---|---|",
    ]

    def row(what: str, s: float, note: str = "") -> None:
        lines.append(f"| {what} | {s:.1f} | {note} |")
        print(f"{what}: {s:.1f} s {note}", flush=True)

    t = time.perf_counter()
    dtypes = warm_defaults(ctx)
    row("engines warmed as the dashboard server warms them", time.perf_counter() - t, f"dtypes {', '.join(dtypes)}")

    d = rollout_defaults(device)
    prompts = tuple(x for x in d.prompts.splitlines() if x.strip())
    spec = RunSpec(
        texts=prompts, dtypes=("bfloat16", "float32"), settings=dataclasses.replace(EngineSettings(), enforce_eager=True)
    )
    units = len(prompts) * d.samples * d.max_tokens
    noise = NOISE_SAMPLES if d.floors else 0
    for seed, label in ((0, "first after the warm-up"), (1, "again")):
        sampling = Sampling(samples=d.samples, max_tokens=d.max_tokens, seed=seed)
        t = time.perf_counter()
        ros = rollout(spec, sampling, ctx, use_cache=False, noise_samples=noise)
        took = time.perf_counter() - t
        work = sum(r.meta.timing["total_s"] - r.meta.timing.get("load_s", 0) - r.meta.timing.get("noise_s", 0) for r in ros)
        row(
            f"Rollout page's default run, {label}",
            took,
            f"{len(prompts)} prompts x {d.samples} x {d.max_tokens} tokens, 2 dtypes, floors "
            f"{'on' if d.floors else 'off'} (target < 60 s: {'met' if took < 60 else 'NOT met'})",
        )
    lines.append(f"| rate: a sampled token's work, per dtype | {work / (2 * units):.4f} | estimate.MEASURED rollout |")
    sampling = Sampling(samples=d.samples, max_tokens=d.max_tokens, seed=2)
    t = time.perf_counter()
    ros = rollout(spec, sampling, ctx, use_cache=False, noise_samples=NOISE_SAMPLES)
    row("the same with the noise floors on", time.perf_counter() - t)
    floors = sum(r.meta.timing.get("noise_s", 0) for r in ros)
    lines.append(
        f"| rate: a sampled token's share of the floors, per dtype | {floors / (2 * units):.4f} | estimate.MEASURED rollout_floors |"
    )

    grid = default_grid(device)
    fd = frontier_defaults(device, [c.name for c in grid if not c.skip])
    configs = [c for c in grid if c.name in fd.configs]
    for text, label in ((SEED_TEXT, "first after the warm-up"), (SEED_TEXT + " Again.", "again")):
        t = time.perf_counter()
        res = frontier(RunSpec(texts=(text,)), configs, ctx, None, speed_load=fd.speed_load, repeats=fd.repeats)
        took = time.perf_counter() - t
        starts = sum(c.get("start_s") or 0 for c in res.configs if not c["skipped"])  # vLLM starts this run paid
        row(
            f"Frontier page's default run, {label}",
            took,
            f"{', '.join(fd.configs)}; speed load {fd.speed_load}, {fd.repeats} repeat(s); vLLM engine starts in it {starts:.1f} s"
            + f" (target < 60 s: {'met' if took < 60 else 'NOT met'})",
        )
    lines.append(
        f"| rate: a frontier configuration once warm | {(took - starts) / len(configs):.2f} | estimate.MEASURED frontier |"
    )
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    ctx.pool.shutdown()


if __name__ == "__main__":
    main()
