"""The engine side of time to first result, without a browser (the GPU machine has no Streamlit):
what `logprob-parity dashboard` does at server start (logprob_parity.analysis.prewarm: the default model's
engines in the default dtypes, one warm-up pass each), then the first comparison of a new text on
those engines, a second one, and for contrast the first comparison on cold engines.

    python benchmarks/first_result.py [--model PATH] [--out FILE]
Prints a markdown table; with --out writes it there. The browser's share (rendering the page) is
measured on the CPU machine by benchmarks/dashboard_timing.py.
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

TEXTS = (
    "The committee will meet on Thursday to review the budget.",
    "Dave lives in Palm Coast, FL and is a lawyer. His personal interests include playing guitar.",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-first-"))
    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.prewarm import default_dtypes, warm_defaults
    from logprob_parity.analysis.request import Context
    from logprob_parity.engines.pool import EnginePool
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    dtypes = default_dtypes(device)
    rows = []
    pool = EnginePool()
    ctx = Context.of(store=Store(), pool=pool)
    t = time.perf_counter()
    warm_defaults(ctx, a.model)
    rows.append((f"server start: {2 * len(dtypes)} engines loaded and warmed (prewarm)", time.perf_counter() - t))
    for i, text in enumerate(TEXTS):
        t = time.perf_counter()
        compare(RunSpec(texts=(text,), model=a.model, dtypes=dtypes), ctx, use_cache=False)
        rows.append(
            (
                f"{'first' if i == 0 else 'second'} Run of a new text on the warm engines (compare, no page)",
                time.perf_counter() - t,
            )
        )
    pool.shutdown()
    cold = EnginePool()
    t = time.perf_counter()
    compare(
        RunSpec(texts=("A cold start: no engine is loaded yet.",), model=a.model, dtypes=dtypes),
        Context.of(store=Store(), pool=cold),
        use_cache=False,
    )
    rows.append(("first Run on cold engines (LPP_PREWARM=0)", time.perf_counter() - t))
    cold.shutdown()
    v = versions()
    head = (
        f"Engine side of time to first result: {a.model or 'demo model (SmolLM2-135M)'}, dtypes {','.join(dtypes)}, "
        f"{device_name(device)}; torch {v['torch']}, transformers {v['transformers']}, vLLM {v['vllm']}\n\n"
    )
    table = "\n".join(["| step | seconds |", "|---|---|"] + [f"| {k} | {s:.2f} |" for k, s in rows])
    print(head + table)
    if a.out:
        Path(a.out).write_text(head + table + "\n")


if __name__ == "__main__":
    main()
