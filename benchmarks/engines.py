"""One run, five measurements (issue 4), printed as ratios and a markdown table.

  a. the forum script's per-prefix HF loop against our HF path (tokens/s)
  b. our vLLM path (worker process, parsing) against a bare LLM.generate(prompt_logprobs=k) on the same ids
  c. our HF scoring in tokens/s against the 2·params·tokens FLOP floor at the matmul rate measured here
  d. end-to-end compare of P prompts x L tokens x 3 dtypes: first run and cached
  e. reopening the stored run (what the dashboard pays)

    python benchmarks/engines.py [--model PATH|demo] [--prompts 4] [--tokens 128] [--dtype bfloat16]
On the H200: --prompts 64 --tokens 512. Writes benchmarks/results/engines-<device>.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def prompts_of(tokenizer, n: int, length: int) -> list[list[int]]:
    text = " ".join((REPO / "core" / "data" / "sentences.txt").read_text().splitlines()) * (1 + n * length // 150)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids[i * 37 : i * 37 + length - len(bos)] for i in range(n)]


def matmul_tflops(torch, device: str, dtype) -> float:
    n = 4096 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 50 if device == "cuda" else 5
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--loop-tokens", type=int, default=32, help="targets scored by the per-prefix loop (it is quadratic)")
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from core import engines
    from core.backends.hf import HFBackend
    from core.compare import compare, load_kwargs, model_max_len
    from core.env import device_name, resolve_device, versions
    from core.models import resolve_model
    from core.spec import DTYPES, EngineSettings, RunSpec
    from core.store import Store

    device = resolve_device("auto")
    model = resolve_model(None if a.model == "demo" else a.model)
    tok = AutoTokenizer.from_pretrained(model.path)
    seqs = prompts_of(tok, a.prompts, a.tokens)
    n_tok = sum(len(s) - 1 for s in seqs)
    rows: list[tuple[str, str]] = []
    tdtype = getattr(torch, a.dtype)

    # a + c: HF in this process
    hf = HFBackend(model.path, a.dtype, device, EngineSettings(), model_max_len(a.tokens, model.max_positions))
    params = sum(p.numel() for p in hf.model.parameters())
    hf.score(seqs[:1], 5)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    hf.score(seqs, 5)
    if device == "cuda":
        torch.cuda.synchronize()
    ours = n_tok / (time.perf_counter() - t)
    ids = seqs[0]
    t = time.perf_counter()
    with torch.inference_mode():
        for end in range(1, 1 + a.loop_tokens):  # the forum script: one forward pass per prefix
            x = torch.tensor([ids[:end]], device=device)
            torch.log_softmax(hf.model(input_ids=x).logits[0, -1].float(), -1)[ids[end]].item()
    loop = a.loop_tokens / (time.perf_counter() - t)
    rows.append(("a. per-prefix loop (forum script)", f"{loop:,.1f} tokens/s ({a.loop_tokens} targets)"))
    rows.append(("a. our HF path", f"{ours:,.0f} tokens/s"))
    rows.append(("a. ratio ours / loop", f"{ours / loop:,.0f}x (loop on a {a.loop_tokens}-token prefix; its cost grows with length)"))
    tflops = matmul_tflops(torch, device, tdtype)
    floor = tflops * 1e12 / (2 * params)
    rows.append(("c. matmul rate measured", f"{tflops:.2f} TFLOP/s ({a.dtype})"))
    rows.append(("c. FLOP floor 2·params·tokens", f"{floor:,.0f} tokens/s ({params / 1e6:.0f}M params)"))
    rows.append(("c. our HF scoring / floor", f"{ours / floor:.1%}"))
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()

    # b: our vLLM path (worker) vs bare LLM.generate in this process
    mml = model_max_len(a.tokens, model.max_positions)
    load = load_kwargs(model, a.dtype, device, EngineSettings(), mml)
    worker = engines.worker_for("vllm", load)
    worker.score(seqs[:1], 5)
    t = time.perf_counter()
    worker.score(seqs, 5)
    ours_v = time.perf_counter() - t
    engines.shutdown_all()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"kv_cache_memory_bytes": 1 << 30} if device == "cpu" else {"gpu_memory_utilization": 0.3}
    llm = LLM(model=model.path, dtype=a.dtype, max_model_len=mml, max_logprobs=5, enforce_eager=True, **kw)
    sp = SamplingParams(prompt_logprobs=5, max_tokens=1, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]
    llm.generate(prompts[:1], sp, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    bare = time.perf_counter() - t
    del llm
    rows.append(("b. bare LLM.generate(prompt_logprobs=5)", f"{n_tok / bare:,.0f} tokens/s"))
    rows.append(("b. our vLLM path (worker, parse)", f"{n_tok / ours_v:,.0f} tokens/s"))
    rows.append(("b. ratio ours / bare (time)", f"{ours_v / bare:.2f}x"))

    # d + e: end to end through compare, fresh store
    home = Path(tempfile.mkdtemp(prefix="lpp-bench-"))
    store = Store(home)
    texts = tuple(tok.decode(s[1:] if s[0] == tok.bos_token_id else s) for s in seqs)
    spec = RunSpec(texts=texts, model=a.model if a.model != "demo" else None, dtypes=DTYPES)
    t = time.perf_counter()
    runs = compare(spec, store=store)
    first = time.perf_counter() - t
    t = time.perf_counter()
    compare(spec, store=store)
    cached = time.perf_counter() - t
    rows.append((f"d. compare {a.prompts}x{a.tokens} tokens x 3 dtypes, first", f"{first:.1f} s"))
    rows.append(("d. the same, cached", f"{cached:.3f} s"))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        store.load(runs[0].run_id)
        times.append(time.perf_counter() - t)
    rows.append((f"e. reopen a stored run ({n_tok} positions)", f"{statistics.median(times) * 1000:.0f} ms (median of 5)"))
    engines.shutdown_all()

    v = versions()
    head = (
        f"Device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {model.name} · {a.prompts} prompts x {a.tokens} tokens · {a.dtype} · {os.cpu_count()} CPU cores · {platform.machine()}"
    )
    table = ["| measurement | result |", "|---|---|"] + [f"| {k} | {val} |" for k, val in rows]
    text = head + "\n\n" + "\n".join(table) + "\n"
    out = REPO / "benchmarks" / "results" / f"engines-{device}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
