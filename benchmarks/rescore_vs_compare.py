"""Issue 31's item 4: a rescore's scored positions/s against a compare's, on the same token ids, in one run.

    python benchmarks/rescore_vs_compare.py [--model PATH] [--sequences 6000] [--prompt 256] [--completion 512]
        [--device auto] [--dtype bfloat16] [--out FILE]

Both score every position of the same sequences with both engines and the exact KL. A rescore also
rescores HF at the logged temperature and builds each part's rows (pieces, prompt texts): that work
now runs beside the engines (logprob_parity.analysis.rescore._RescoreHere). Target on the H200 (1.1B
shape, 6,000 sequences of 256 + 512 tokens): the rescore's scored positions/s at least 0.9x the
compare's. The compare scores the ids directly: its texts are placeholders, and its Prepared holds the
logged ids as its tokens (a compare otherwise tokenizes text). Rates are steady ones, from each run's
first finished batch to its last, so engine starts are not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    from benchmarks.rescore_scale import logged_lines, scale_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scale_args(ap)
    ap.set_defaults(sequences=6000, prompt=256, completion=512)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    from logprob_parity.analysis.compare import compare_prepared
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.analysis.rescore import rescore
    from logprob_parity.env import resolve_device, versions
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    home = Path(tempfile.mkdtemp(prefix="lpp-rescore-vs-compare-"))
    path = home / "logged.jsonl"
    with path.open("w") as f:
        f.writelines(logged_lines(a))
    records = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [r["prompt_token_ids"] + r["completion_token_ids"] for r in records]
    positions = sum(len(x) - 1 for x in ids)
    completion = sum(len(r["completion_token_ids"]) for r in records)
    device = resolve_device(a.device)

    def steady(run: callable) -> tuple[float, float]:
        ticks: list[tuple[float, int]] = []
        t = time.perf_counter()
        run(lambda d, x: ticks.append((time.perf_counter(), x["done"])))
        (t0, d0), (t1, d1) = ticks[0], ticks[-1]
        return (d1 - d0) / (t1 - t0), time.perf_counter() - t

    def run_compare(on_status: callable) -> None:
        spec = RunSpec(
            texts=tuple(f"logged sequence {i}" for i in range(len(ids))), model=a.model, dtypes=(a.dtype,), device=device
        )
        p = prepare(spec, Context.of(store=Store(home / "compare"), on_status=on_status))
        p.__dict__["_encoded"] = (ids, False, None)  # the logged ids are this compare's tokens
        compare_prepared(p, use_cache=False)

    def run_rescore(on_status: callable) -> None:
        spec = RunSpec(texts=("logged",), model=a.model, dtypes=(a.dtype,), device=device)
        rescore(path, path.name, spec, Context.of(store=Store(home / "rescore"), on_status=on_status), use_cache=False)

    c_rate, c_wall = steady(run_compare)  # positions/s
    r_rate, r_wall = steady(run_rescore)  # logged completion tokens/s
    r_pos = r_rate * positions / completion  # as scored positions/s (prompt tokens included)
    v = versions()
    lines = [
        f"# A rescore against a compare on the same ids ({device}, {a.dtype}, exact KL)",
        "",
        f"model {a.model}; {a.sequences} sequences of {a.prompt} + {a.completion} tokens ({positions:,} scored positions); "
        f"vLLM {v['vllm']}, transformers {v['transformers']}, torch {v['torch']}",
        "",
        "| run | wall s (engine starts included) | steady scored positions/s |",
        "|---|---|---|",
        f"| compare | {c_wall:.1f} | {c_rate:,.0f} |",
        f"| rescore | {r_wall:.1f} | {r_pos:,.0f} ({r_rate:,.0f} logged tokens/s) |",
        "",
        f"rescore / compare: {r_pos / c_rate:.2f}x (target at least 0.9x on the H200)",
    ]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
