"""The dashboard's switch from one model to another, both small: how long until both engines (HF and
vLLM) of the second model have loaded, three ways, on the engine pool the dashboard uses.

  cold    a fresh pool: two new processes import torch, transformers and vLLM, then load (today's
          switch, and every switch before spares and swaps)
  spare   the dashboard's pool (keep_spares): the first model's job ended, so a spare per backend
          did its imports while the person read the result; the second model loads into them
  swap    a pool at its cap (LPP_MAX_WARM_ENGINES=2, no spares): the first model's hosts are
          stopped for room, and each loads the second model in its own process

    python benchmarks/model_switch.py [--repeats 3] [--dtype float32]

Writes benchmarks/results/model_switch_<device>.md. The first model is the tiny Llama the tests
build, the second the demo model (SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _pair(model: Path, dtype: str):
    from logprob_parity.engines.records import LoadRequest

    return [LoadRequest(b, str(model), dtype, "cpu", max_model_len=128) for b in ("hf", "vllm")]


def _load(engines, requests) -> float:
    """Seconds until every engine of `requests` has loaded, from the lease."""
    t0 = time.perf_counter()
    with engines.lease(requests) as lease:
        for r in requests:
            lease.host(r)
        took = time.perf_counter() - t0
    return took


def _wait_spares(engines, n: int, timeout: float = 300.0) -> float:
    """Seconds until `n` spares have finished their imports (what the person's reading time covers)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        spares = engines.spares()
        if len(spares) >= n and all(h._preparer is not None and not h._preparer.is_alive() for h in spares):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise TimeoutError("the spares did not finish their imports")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from logprob_parity.engines.pool import EnginePool
    from logprob_parity.inputs.demo import build_demo_model

    from builders import build_tiny_llama

    first, second = build_tiny_llama("tiny-llama-bos", adds_bos=True), build_demo_model()
    a, b = _pair(first, args.dtype), _pair(second, args.dtype)
    times: dict[str, list[float]] = {"cold": [], "spare": [], "swap": []}
    spare_imports: list[float] = []
    for _ in range(args.repeats):
        cold = EnginePool()
        times["cold"].append(_load(cold, b))
        cold.shutdown()

        dash = EnginePool(keep_spares=True)
        _load(dash, a)
        spare_imports.append(_wait_spares(dash, 2))
        times["spare"].append(_load(dash, b))
        dash.shutdown()

        os.environ["LPP_MAX_WARM_ENGINES"] = "2"
        capped = EnginePool()
        _load(capped, a)
        times["swap"].append(_load(capped, b))
        capped.shutdown()
        del os.environ["LPP_MAX_WARM_ENGINES"]

    med = {k: statistics.median(v) for k, v in times.items()}
    import torch
    import transformers
    import vllm

    lines = [
        f"# The dashboard's model switch ({platform.node()}, {os.cpu_count()} cores, CPU)",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, vLLM {vllm.__version__}; "
        f"{args.dtype}; from the tiny Llama to the demo model (SmolLM2-135M), HF and vLLM engines loading side by side; "
        f"{args.repeats} repeats, median (all runs in brackets). `python benchmarks/model_switch.py`",
        "",
        "| switch | seconds until both engines loaded | x faster than cold |",
        "|---|---|---|",
    ]
    for k in ("cold", "spare", "swap"):
        runs = ", ".join(f"{t:.1f}" for t in times[k])
        lines.append(f"| {k} | {med[k]:.1f} ({runs}) | {med['cold'] / med[k]:.2f} |")
    lines += [
        "",
        f"The spares' imports, after the first model's job ended: {statistics.median(spare_imports):.1f} s "
        "(the person reads the first result meanwhile).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = REPO / "benchmarks" / "results" / "model_switch_cpu.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
