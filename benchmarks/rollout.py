"""Rollout cost against the bare minimum: `logprob-parity rollout` (vLLM decode, then vLLM prefill
and HF rescoring the same ids) against a bare `LLM.generate` with `logprobs=1` plus a bare batched
HF forward over the same prompt+completion ids. Target on the H200: at most 1.3x.

    python benchmarks/rollout.py [--model PATH] [--prompts 64] [--tokens 512] [--dtype bfloat16] [--out FILE]

Both sides run warm (engines started and used once before timing); all completions run to
--tokens (ignore_eos) so both sides score the same number of tokens. Noise floors are left out of
the ratio and timed on their own.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--hf-batch-size",
        default="1,16",
        help="our HF side's hf_batch_size setting(s), comma-separated: 1 = one sequence a pass (the default)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-rollout-bench-"))
    import dataclasses

    import torch

    from logprob_parity.analysis.request import Context
    from logprob_parity.analysis.rollout import rollout
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.demo import build_demo_model
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import Sampling
    from logprob_parity.results.store import Store

    model = a.model or str(build_demo_model())
    device = resolve_device("auto")
    lines = (REPO / "logprob_parity" / "data" / "sentences.txt").read_text().splitlines()
    prompts = tuple(f"{lines[i % len(lines)]} ({i})" for i in range(a.prompts))
    sampling = Sampling(samples=1, temperature=1.0, max_tokens=a.tokens, seed=0, ignore_eos=True)
    ctx = Context.of(store=Store())
    rows: list[tuple[str, float]] = []
    results = {}
    for bs in [int(x) for x in a.hf_batch_size.split(",")]:
        settings = dataclasses.replace(EngineSettings(), enforce_eager=None if device != "cpu" else True, hf_batch_size=bs)
        spec = RunSpec(texts=prompts, model=model, dtypes=(a.dtype,), device=device, settings=settings)
        # warm: the same engines (the same max_model_len) start and run once before timing
        t = time.perf_counter()
        rollout(
            dataclasses.replace(spec, texts=prompts[:2]),
            dataclasses.replace(sampling, seed=99),
            ctx,
            use_cache=False,
            noise_samples=0,
        )
        rows.append(
            (
                f"ours, hf_batch_size {bs}: engines start (if not warm) + a first rollout of 2 prompts, not in the ratio",
                time.perf_counter() - t,
            )
        )
        t = time.perf_counter()
        (ro,) = rollout(spec, sampling, ctx, use_cache=False, noise_samples=0)
        ours = time.perf_counter() - t
        tm = ro.meta.timing
        parts = tm["sample_s"] + tm["prefill_s"] + tm["hf_s"]
        rows += [
            (f"**ours, hf_batch_size {bs}: rollout with the three scorings**", ours),
            ("  of which vLLM decode", tm["sample_s"]),
            ("  of which vLLM prefill", tm["prefill_s"]),
            ("  of which HF", tm["hf_s"]),
            ("  of which the rest (pieces, metrics, store)", ours - parts),
        ]
        results[bs] = (ours, ro)
    t = time.perf_counter()
    (noisy,) = rollout(spec, dataclasses.replace(sampling, seed=1), ctx, use_cache=False, noise_samples=2)
    with_floors = time.perf_counter() - t
    noise_s = noisy.meta.timing["noise_s"]
    rows.append((f"ours, hf_batch_size {bs}: the same with the noise floors (2 samples), not in the ratio", with_floors))
    rows.append(("  of which the noise floors", noise_s))
    floors_ratio = noise_s / (with_floors - noise_s)
    ctx.pool.shutdown()
    ro = results[min(results)][1]
    full = [list(s.prompt_token_ids) + list(s.completion_token_ids) for s in ro.samples]
    n_tok = sum(len(s.completion_token_ids) for s in ro.samples)

    # bare vLLM: generate with logprobs=1, same prompts, same settings of CUDA graphs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        dtype=a.dtype,
        enforce_eager=device == "cpu",
        max_model_len=ro.meta.settings["max_model_len"],
        gpu_memory_utilization=0.3,
        **({} if device != "cpu" else {"kv_cache_memory_bytes": 2 << 30}),
    )
    reqs = [TokensPrompt(prompt_token_ids=list(s.prompt_token_ids)) for s in ro.samples]
    params = [SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True, logprobs=1, seed=k) for k in range(len(reqs))]
    llm.generate(reqs[:2], params[:2], use_tqdm=False)  # warm
    t = time.perf_counter()
    llm.generate(reqs, params, use_tqdm=False)
    bare_gen = time.perf_counter() - t
    llm.llm_engine.engine_core.shutdown()
    del llm

    # bare HF: batched forward (right-padded, 16 a pass) + float32 log_softmax gather on the same ids
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, a.dtype)).to(device).eval()

    def hf_pass() -> None:
        with torch.inference_mode():
            for lo in range(0, len(full), 16):
                chunk = full[lo : lo + 16]
                w = max(map(len, chunk))
                x = torch.zeros((len(chunk), w), dtype=torch.long, device=device)
                mask = torch.zeros_like(x)
                for b, ids in enumerate(chunk):
                    x[b, : len(ids)] = torch.tensor(ids, device=device)
                    mask[b, : len(ids)] = 1
                logits = hf(input_ids=x, attention_mask=mask).logits[:, :-1]
                for b, ids in enumerate(chunk):
                    lp = torch.log_softmax(logits[b, : len(ids) - 1].float(), dim=-1)
                    lp.gather(1, x[b, 1 : len(ids), None])
            if device != "cpu":
                torch.cuda.synchronize()

    hf_pass()  # warm
    t = time.perf_counter()
    hf_pass()
    bare_hf = time.perf_counter() - t
    bare = bare_gen + bare_hf
    hf = None  # freed: the next model is ours
    # where HF's side goes: our HF backend's rollout_score in this process (no host, no socket), warm
    from logprob_parity.engines.backends.hf import HFBackend

    ours_hf = HFBackend(
        model, a.dtype, device, dataclasses.replace(EngineSettings(), hf_batch_size=16), ro.meta.settings["max_model_len"]
    )
    starts = [len(s.prompt_token_ids) for s in ro.samples]
    ours_hf.rollout_score(full[:4], starts[:4])
    t = time.perf_counter()
    ours_hf.rollout_score(full, starts)
    if device != "cpu":
        torch.cuda.synchronize()
    rows.append(("diagnosis: our HF rollout_score in this process (batch 16, no host), warm", time.perf_counter() - t))
    rows += [
        ("bare: LLM.generate with logprobs=1", bare_gen),
        ("bare: HF batched forward + log_softmax", bare_hf),
        ("bare: sum", bare),
    ]
    v = versions()
    out = [
        f"# Rollout benchmark: {a.prompts} prompts x {a.tokens} sampled tokens, {a.dtype}",
        "",
        f"device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {Path(model).name} · CUDA graphs {'off (CPU)' if device == 'cpu' else 'on'}",
        "",
        "| step | seconds |",
        "|---|---|",
        *[f"| {k} | {s:.2f} |" for k, s in rows],
        "",
    ]
    for bs, (ours, _) in results.items():
        out.append(
            f"- **hf_batch_size {bs}: ratio ours / bare = {ours / bare:.3f}** (target <= 1.3) · {n_tok} completion tokens · "
            f"ours {n_tok / ours:,.0f} tokens/s · bare {n_tok / bare:,.0f} tokens/s"
        )
    out.append(f"- **noise floors / the rollout they belong to = {floors_ratio:.2f}** (target <= 2)")
    text = "\n".join(out)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
