"""Where the noise floor's time goes: each call the floor makes to HF's and vLLM's hosts, timed.

    python benchmarks/floor_profile.py [--model tinyllama|demo|PATH] [--tokenizer DIR] [--prompts 64]
                                       [--tokens 512] [--dtype bfloat16] [--hf-batch 32] [--out FILE]

benchmarks/compare_speed.py gives the floor's cost against a compare without it; this script says
which of its calls (the large micro-batch right and left padded, the packed row, the chunks through
HF's KV cache, the top-up, vLLM alone and batched) takes it, with each call's rows, positions, the
longest sequence and its padded positions. It warms the engines with one compare, then profiles a
second one. LPP_HF_TIMING=1 adds the HF host's own phases (forward, log_softmax, ...) to stderr.
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


class Timed:
    """A host whose calls are timed and logged (name, rows, positions, longest, seconds)."""

    def __init__(self, host, side: str, log: list) -> None:
        self._host, self._side, self._log = host, side, log

    def __getattr__(self, name):
        f = getattr(self._host, name)
        if not callable(f):
            return f

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = f(*args, **kwargs)
            seqs = args[0] if args and isinstance(args[0], list) else []
            lens = [len(s) for s in seqs] or [0]
            extra = {k: v for k, v in kwargs.items() if k in ("chunk",)}
            if name == "score" and len(args) > 3:
                extra["batch_size"] = args[3]
            self._log.append((self._side, name, len(seqs), sum(lens), max(lens), extra, time.perf_counter() - t))
            return out

        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tinyllama", help="tinyllama (random 1.1B shape), demo, or a model folder")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-floor-"))

    from benchmarks.engines import model_and_texts
    from logprob_parity.analysis import floors
    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines import pool
    from logprob_parity.env import resolve_device
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    model, texts = model_and_texts(a.model, a.tokenizer, a.prompts, a.tokens, device, "lpp-floor-model-")
    store = Store(Path(os.environ["LOGPROB_PARITY_HOME"]))
    settings = dataclasses.replace(EngineSettings(), hf_batch_size=a.hf_batch)
    log: list = []
    measure = floors.measure

    def timed_measure(vllm, hf, *args, **kwargs):
        t = time.perf_counter()
        out = measure(Timed(vllm, "vllm", log), Timed(hf, "hf", log), *args, **kwargs)
        log.append(("all", "measure", 0, 0, 0, {}, time.perf_counter() - t))
        return out

    floors.measure = timed_measure

    def run():
        start = time.perf_counter()
        spec = RunSpec(texts=texts, model=model.path, dtypes=(a.dtype,), device=device, settings=settings)
        (r,) = compare(spec, store=store, use_cache=False)
        return r, time.perf_counter() - start

    run()
    log.clear()
    r, took = run()
    pool.shutdown_all()
    lines = [
        f"floor_profile: {model.name}, {a.prompts} x {a.tokens} tokens, {a.dtype}, {device}, hf_batch_size {a.hf_batch}; "
        f"compare with its floor {took:.3f} s; floor's engine time {r.meta.timing.get('noise_s', 0):.3f} s; "
        f"sample {r.meta.noise.get('noise_texts')} text(s), {r.meta.noise.get('noise_tokens')} tokens",
        "",
        "| side | call | rows | positions | longest | padded (rows x longest) | args | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, name, rows, pos, longest, extra, s in log:
        lines.append(f"| {side} | {name} | {rows} | {pos:,} | {longest} | {rows * longest:,} | {extra or ''} | {s:.3f} |")
    text = "\n".join(lines)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
