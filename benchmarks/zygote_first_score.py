"""A forked engine host's start and first score, with and without the zygote's prefork work
(`VLLMBackend.prefork`: vLLM's torch.compile'd token ranker compiled, and the modules an engine's
start imports imported, once before the forks).

Why: every new vLLM engine process traced and compiled that function on its first score, about 2 s of
CPU here, which a test session paid for each of its ~150 vLLM hosts, and a dashboard for each model it
switched to. Each row forks a child from this process, as the zygote does (gc frozen), loads the model
there and times its first three scores; the values must be equal with and without.

    .venv/bin/python benchmarks/zygote_first_score.py [MODEL_FOLDER ...]   (default: the demo model)
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time


def child(model: str, ids: list[int], max_len: int) -> None:
    from logprob_parity.engines.backends.vllm import VLLMBackend
    from logprob_parity.inputs.spec import EngineSettings

    before = len(sys.modules)
    t = time.perf_counter()
    engine = VLLMBackend(model, "bfloat16", "cpu", EngineSettings(), max_len)
    init = time.perf_counter() - t
    imported = len(sys.modules) - before
    times, first = [], None
    for _ in range(3):
        t = time.perf_counter()
        got = engine.score([ids], 5)[0]
        times.append(time.perf_counter() - t)
        first = hashlib.sha256(got.logprob.tobytes()).hexdigest()[:12] if first is None else first
    print(
        f"| {os.path.basename(model)} | {os.environ['LPP_BENCH_PREFORK']} | {init:.2f} | {imported} | {' / '.join(f'{x:.2f}' for x in times)} | {first} |"
    )
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    from logprob_parity.engines.host import host_env

    os.environ.update(host_env({}))
    from logprob_parity.engines.backends.vllm import VLLMBackend
    from logprob_parity.inputs.demo import build_demo_model

    models = sys.argv[1:] or [str(build_demo_model())]
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs\n")
    print(
        "| model | prefork in the parent | engine init s | modules it imported | first / second / third score s | sha256 of the first score's logprobs |"
    )
    print("|---|---|---|---|---|---|")
    for prefork in (False, True):  # without first: once compiled, this process keeps it
        os.environ["LPP_BENCH_PREFORK"] = "yes" if prefork else "no"
        if prefork:
            VLLMBackend.prefork()
        gc.freeze()
        for model in models:
            with open(os.path.join(model, "config.json")) as f:
                config = json.load(f)
            vocab, max_len = config["vocab_size"], min(512, config.get("max_position_embeddings", 512))
            ids = [1] + [(7 * i) % (vocab - 2) + 2 for i in range(30)]
            pid = os.fork()
            if pid == 0:
                child(model, ids, max_len)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
