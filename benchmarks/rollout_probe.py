"""Where the rollout's HF side spends its time, in the host against in this process.

    LPP_HF_TIMING=1 python benchmarks/rollout_probe.py [--model PATH] [--prompts 64] [--tokens 512] [--out FILE]

One rollout (CUDA graphs on, as rollouts run) leaves its engines warm; then the HF host scores the
same prompt+completion ids with `rollout_score` twice without the exact KL and twice with it (vLLM's
rows shared by this device's transport), and with `score` (the comparison's path) once; each call is
timed from here and, with LPP_HF_TIMING=1, by phase inside the host (its log's [lpp-timing] lines).
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
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-probe-"))
    os.environ.setdefault("LPP_HF_TIMING", "1")
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.analysis.rollout import _engines, rollout, with_rollout_defaults
    from logprob_parity.engines import fullvocab
    from logprob_parity.env import resolve_device
    from logprob_parity.inputs.demo import build_demo_model
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import Sampling

    model = a.model or str(build_demo_model())
    device = resolve_device("auto")
    lines = (REPO / "logprob_parity" / "data" / "sentences.txt").read_text().splitlines()
    prompts = tuple(f"{lines[i % len(lines)]} ({i})" for i in range(a.prompts))
    sampling = Sampling(samples=1, temperature=1.0, max_tokens=a.tokens, seed=0, ignore_eos=True)
    settings = dataclasses.replace(EngineSettings(), enforce_eager=None if device != "cpu" else True, hf_batch_size=16)
    ctx = Context.of()
    spec = with_rollout_defaults(RunSpec(texts=prompts, model=model, dtypes=(a.dtype,), device=device, settings=settings))
    out: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    t = time.perf_counter()
    rollout(dataclasses.replace(spec, texts=prompts[:2]), sampling, ctx, use_cache=False, noise_samples=0)
    say(f"engines started, a 2-prompt rollout: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    (ro,) = rollout(spec, sampling, ctx, use_cache=False, noise_samples=0)
    say(f"rollout {a.prompts} x {a.tokens}: {time.perf_counter() - t:.2f} s; timing {ro.meta.timing}")
    full = [list(s.prompt_token_ids) + list(s.completion_token_ids) for s in ro.samples]
    starts = [len(s.prompt_token_ids) for s in ro.samples]
    p = prepare(spec, ctx)
    vreq, hreq = _engines(p, a.dtype, sampling)
    with ctx.pool.lease([vreq, hreq]) as lease:
        v, h = lease.host(vreq), lease.host(hreq)
        for k in range(2):
            t = time.perf_counter()
            h.rollout_score(full, starts)
            say(f"host rollout_score, no KL ({k + 1}): {time.perf_counter() - t:.3f} s")
        for k in range(2):
            ex = fullvocab.Exchange(sum(len(f) - 1 for f in full), p.model.vocab_size, device)
            try:
                v.score(full, 1, None, None, "right", ex.vllm_target)
                ex.after_vllm(v)
                t = time.perf_counter()
                h.rollout_score(full, starts, 1.0, -1, 1.0, None, ex.hf_source)
                say(f"host rollout_score with the exact KL ({ex.kind}) ({k + 1}): {time.perf_counter() - t:.3f} s")
            finally:
                ex.close(v)
        t = time.perf_counter()
        h.score(full, 1)
        say(f"host score (the comparison's path), no KL: {time.perf_counter() - t:.3f} s")
        # is the first call slow because its shapes are new, or because vLLM just used the card?
        v.score(full, 1, None, None, "right", None)
        t = time.perf_counter()
        h.rollout_score(full, starts)
        say(f"host rollout_score right after a vLLM prefill, widths seen before: {time.perf_counter() - t:.3f} s")
        shorter = [f[:-5] for f in full]
        for k in range(2):
            t = time.perf_counter()
            h.rollout_score(shorter, starts)
            say(
                f"host rollout_score on new widths (5 tokens shorter), no vLLM call before ({k + 1}): {time.perf_counter() - t:.3f} s"
            )
        say("host log, timing lines:")
        out.extend(ln for ln in h.log_tail(200_000).splitlines() if "[lpp-timing]" in ln)
        print("\n".join(ln for ln in out if "[lpp-timing]" in ln))
    t = time.perf_counter()
    (ro,) = rollout(spec, sampling, ctx, use_cache=False, noise_samples=0)
    say(
        f"the same rollout again (same widths, hf_cudnn_attention {spec.settings.hf_cudnn_attention}): {time.perf_counter() - t:.2f} s; timing {ro.meta.timing}"
    )
    if device != "cpu" or os.environ.get("LPP_PROBE_ALL"):  # HF's attention without cuDNN: a new HF engine, the same vLLM one
        off = dataclasses.replace(spec, settings=dataclasses.replace(settings, hf_cudnn_attention=False))
        rollout(dataclasses.replace(off, texts=prompts[:2]), sampling, ctx, use_cache=False, noise_samples=0)
        for k in range(2):
            t = time.perf_counter()
            (ro,) = rollout(off, sampling, ctx, use_cache=False, noise_samples=0)
            say(f"rollout with hf_cudnn_attention off ({k + 1}): {time.perf_counter() - t:.2f} s; timing {ro.meta.timing}")
        more = tuple(f"{x} Once more, and longer: {x}" for x in prompts)  # other prompts: new widths
        t = time.perf_counter()
        (ro,) = rollout(dataclasses.replace(off, texts=more), sampling, ctx, use_cache=False, noise_samples=0)
        say(
            f"rollout with hf_cudnn_attention off, new prompts (new widths): {time.perf_counter() - t:.2f} s; timing {ro.meta.timing}"
        )
        t = time.perf_counter()
        on = dataclasses.replace(spec, texts=more, settings=dataclasses.replace(spec.settings, hf_cudnn_attention=True))
        (ro,) = rollout(on, sampling, ctx, use_cache=False, noise_samples=0)
        say(
            f"rollout with cuDNN attention (torch's choice), new prompts (new widths): {time.perf_counter() - t:.2f} s; timing {ro.meta.timing}"
        )
    ctx.pool.shutdown()
    if a.out:
        Path(a.out).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
