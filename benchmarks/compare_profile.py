"""Where a warm compare's time goes outside the engines: cProfile of this process during one compare.

    python benchmarks/compare_profile.py [--model tinyllama|demo|PATH] [--prompts 64] [--tokens 512]
                                         [--dtype bfloat16] [--hf-batch 32] [--hf-cudnn-attention on|off] [--tokenizer DIR] [--exact-kl] [--out FILE]

benchmarks/compare_speed.py gives the ratio to the bare engines and splits a compare into vLLM
scoring, HF scoring (host round trips included) and "the rest in this process"; this script says
what that rest is. It warms the engines, runs the same compare (no exact KL, no noise floor) twice
more, the second under cProfile, and writes the functions by cumulative time. The profile is of this
process's main thread: the engine hosts are processes of their own (their time shows as waiting on
their connection), and the thread that names tokens while the engines score shows only where the
main thread waits for it. Default model: TinyLlama-1.1B's shape with random weights and the demo
model's tokenizer (as compare_speed.py).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tinyllama", help="tinyllama (random 1.1B shape), demo, or a model folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the random model (default: the demo model's)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-cudnn-attention", choices=("default", "on", "off"), default="default")
    ap.add_argument("--top", type=int, default=45, help="functions listed")
    ap.add_argument(
        "--exact-kl", action="store_true", help="compare with the exact KL (LPP_HF_TIMING=1 prints the HF host's phases)"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-profile-"))
    if os.environ.get("TOKENIZERS_PARALLELISM") == "false" and not os.environ.get("LPP_KEEP_TOKENIZERS_SERIAL"):
        del os.environ["TOKENIZERS_PARALLELISM"]  # as compare_speed.py: this process as a user runs it

    from benchmarks.engines import model_and_texts
    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines import fullvocab, pool
    from logprob_parity.env import resolve_device
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    model, texts = model_and_texts(a.model, a.tokenizer, a.prompts, a.tokens, device, "lpp-profile-model-")
    store = Store(Path(os.environ["LOGPROB_PARITY_HOME"]))
    cudnn = {"default": None, "on": True, "off": False}[a.hf_cudnn_attention]
    settings = dataclasses.replace(EngineSettings(), hf_batch_size=a.hf_batch, hf_cudnn_attention=cudnn)
    fullvocab.ENABLED = a.exact_kl

    def run(t: tuple[str, ...]):
        start = time.perf_counter()
        (r,) = compare(
            RunSpec(texts=t, model=model.path, dtypes=(a.dtype,), device=device, settings=settings, noise_floor=False),
            store=store,
            use_cache=False,
        )
        return r, time.perf_counter() - start

    run(texts[:2])
    _, warm = run(texts)  # HF's first pass over these batch shapes happens here, not in the profile
    prof = cProfile.Profile()
    prof.enable()
    r, took = run(texts)
    prof.disable()
    pool.shutdown_all()
    tm = r.meta.timing
    rest = took - tm["vllm_score_s"] - tm["hf_score_s"]
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(a.top)
    buf.write("\nBy own time (what this process computes, not what it waits for):\n")
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    head = (
        f"compare_profile: {model.name}, {a.prompts} x {a.tokens} tokens, {a.dtype}, {device}, hf_batch_size {a.hf_batch}, hf_cudnn_attention {a.hf_cudnn_attention}, "
        f"exact KL {'on: ' + r.meta.env.vllm_engine['kl_full'] if a.exact_kl else 'off'}; "
        f"first timed compare {warm:.3f} s, profiled {took:.3f} s (under cProfile): vLLM {tm['vllm_score_s']:.3f} s, "
        f"HF {tm['hf_score_s']:.3f} s, the rest in this process {rest:.3f} s"
    )
    text = head + "\n\n" + buf.getvalue()
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
