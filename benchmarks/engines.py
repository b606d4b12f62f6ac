"""One run, every measurement of issue 4, printed as ratios and a markdown table.

  a. the forum script's per-prefix HF loop against our HF path (tokens/s, same prompt length)
  b. our vLLM path (worker process, parsing) against a bare LLM.generate(prompt_logprobs=k) on the same ids,
     and the time one vLLM engine takes to start in its own process
  c. our HF scoring in tokens/s against the 2·params·tokens FLOP floor at the matmul rate measured here
  d. the forum sentence in float16+bfloat16+float32 on cold engines, then again on the warm ones;
     end-to-end compare of P prompts x L tokens x 3 dtypes: first run and cached
  e. reopening the stored P x L run (what the dashboard pays)

    python benchmarks/engines.py [--model PATH|demo|tinyllama] [--prompts 4] [--tokens 128] [--dtype bfloat16]
On the H200: --model tinyllama --prompts 64 --tokens 512 (a TinyLlama-shaped 1.1B model, random
weights, the demo model's tokenizer or --tokenizer's). Writes benchmarks/results/engines-<device>.md as it goes.
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

# TinyLlama-1.1B's shape; the vocabulary is the tokenizer's.
TINYLLAMA = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def build_tinyllama(out: Path, tokenizer_path: str, device: str) -> str:
    """Random weights (std 0.02) in bfloat16, saved as a plain HF folder with the given tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    cfg = LlamaConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **TINYLLAMA
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return str(out)


def prompts_of(tokenizer, n: int, length: int) -> list[list[int]]:
    from logprob_parity.inputs.prompts import filler_ids

    return filler_ids(tokenizer, n, length)


def model_and_texts(name: str, tokenizer: str | None, n: int, length: int, device: str, prefix: str):
    """A profiling script's model (tinyllama: the random 1.1B shape built now; demo; or a folder) and
    n filler texts of `length` tokens as text (the BOS left for the comparison to add)."""
    import tempfile

    from transformers import AutoTokenizer

    from logprob_parity.inputs.models import resolve_model

    if name == "tinyllama":
        work = Path(tempfile.mkdtemp(prefix=prefix))
        model = resolve_model(build_tinyllama(work / "tinyllama-1.1b-random", tokenizer or resolve_model(None).path, device))
    else:
        model = resolve_model(None if name == "demo" else name)
    tok = AutoTokenizer.from_pretrained(model.path)
    seqs = prompts_of(tok, n, length)
    return model, tuple(tok.decode(s[1:] if s and s[0] == tok.bos_token_id else s) for s in seqs)


def matmul_tflops(torch, device: str, dtype) -> float:
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 50 if device == "cuda" else 5
    for _ in range(3):
        a @ b
    sync(torch, device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(torch, device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Table:
    """Rows written to the results file as soon as they exist: a run cut short keeps what it measured."""

    def __init__(self, path: Path, head: str) -> None:
        self.path, self.head, self.rows = path, head, []
        path.parent.mkdir(exist_ok=True)

    def add(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"{name}: {value}", flush=True)
        self.path.write_text(self.text())

    def text(self) -> str:
        lines = ["| measurement | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in self.rows]
        return self.head + "\n\n" + "\n".join(lines) + "\n"


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help="demo, tinyllama (random 1.1B) or a folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for tinyllama (default: the demo model's)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=16, help="hf_batch_size for the batched HF measurement")
    ap.add_argument(
        "--parts",
        default="hf,vllm,forum,set",
        help="hf (a, c), vllm (b), forum (d, three dtypes of one sentence), set (d, e: P x L x 3 dtypes)",
    )
    ap.add_argument(
        "--loop-tokens",
        type=int,
        default=None,
        help="targets the per-prefix loop scores (default: the whole prompt on a GPU, 32 on the CPU)",
    )
    a = ap.parse_args()
    parts = set(a.parts.split(","))

    import torch
    from transformers import AutoTokenizer

    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import model_max_len
    from logprob_parity.engines import pool
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.prompts import SEED_TEXT
    from logprob_parity.inputs.spec import DTYPES, EngineSettings, RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    work = Path(tempfile.mkdtemp(prefix="lpp-bench-"))
    if a.model == "tinyllama":
        tokenizer = a.tokenizer or resolve_model(None).path
        model = resolve_model(build_tinyllama(work / "tinyllama-1.1b-random", tokenizer, device))
    else:
        model = resolve_model(None if a.model == "demo" else a.model)
    tok = AutoTokenizer.from_pretrained(model.path)
    seqs = prompts_of(tok, a.prompts, a.tokens)
    n_tok = sum(len(s) - 1 for s in seqs)
    tdtype = getattr(torch, a.dtype)
    v = versions()
    table = Table(
        REPO / "benchmarks" / "results" / f"engines-{device}.md",
        f"Device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {model.name} · {a.prompts} prompts x {a.tokens} tokens · {a.dtype} · {os.cpu_count()} CPU cores · "
        f"{platform.machine()} · `python benchmarks/engines.py {' '.join(sys.argv[1:])}`",
    )
    mml = model_max_len(a.tokens, model.max_positions)

    # a + c: HF in this process
    if "hf" in parts:
        hf = HFBackend(model.path, a.dtype, device, EngineSettings(), mml)
        params = sum(p.numel() for p in hf.model.parameters())

        def scoring(backend: HFBackend, bs: int) -> tuple[float, float]:
            """(seconds of the warm-up call, which compiles under hf_compile; tokens/s over all prompts)."""
            _, warm = timed(lambda: (backend.score(seqs[:bs], 5, batch_size=bs), sync(torch, device)))
            _, took = timed(lambda: (backend.score(seqs, 5, batch_size=bs), sync(torch, device)))
            return warm, n_tok / took

        rates = {bs: scoring(hf, bs)[1] for bs in (1, a.hf_batch)}

        @torch.inference_mode()
        def forward_only(backend) -> None:
            for i in range(0, len(seqs), a.hf_batch):
                backend._forward(seqs[i : i + a.hf_batch], "right")
            sync(torch, device)

        _, fwd = timed(forward_only, hf)
        ids = seqs[0]
        n_loop = a.loop_tokens or (len(ids) - 1 if device == "cuda" else 32)
        t = time.perf_counter()
        with torch.inference_mode():
            for end in range(1, 1 + n_loop):  # the forum script: one forward pass per prefix, no cache
                x = torch.tensor([ids[:end]], device=device)
                torch.log_softmax(hf.model(input_ids=x).logits[0, -1].float(), -1)[ids[end]].item()
        loop = n_loop / (time.perf_counter() - t)
        table.add("a. per-prefix loop (forum script)", f"{loop:,.1f} tokens/s ({n_loop} targets of one {len(ids)}-token prompt)")
        table.add("a. our HF path, hf_batch_size=1", f"{rates[1]:,.0f} tokens/s")
        table.add(f"a. our HF path, hf_batch_size={a.hf_batch}", f"{rates[a.hf_batch]:,.0f} tokens/s")
        table.add(
            "a. ratio ours / loop", f"{rates[1] / loop:,.0f}x (batch 1), {rates[a.hf_batch] / loop:,.0f}x (batch {a.hf_batch})"
        )
        tflops = matmul_tflops(torch, device, tdtype)
        floor = tflops * 1e12 / (2 * params)
        table.add("c. matmul rate measured", f"{tflops:.1f} TFLOP/s ({a.dtype}, square matmul)")
        table.add("c. FLOP floor 2·params·tokens", f"{floor:,.0f} tokens/s ({params / 1e6:,.0f}M params)")
        table.add(
            "c. our HF scoring / floor", f"{rates[1] / floor:.1%} (batch 1), {rates[a.hf_batch] / floor:.1%} (batch {a.hf_batch})"
        )
        table.add(
            "c. HF forward pass alone / floor", f"{n_tok / fwd / floor:.1%} (batch {a.hf_batch}: {n_tok / fwd:,.0f} tokens/s)"
        )
        del hf
        # the same with hf_compile: inductor-fused forward and logprob blocks, compiled on the first call
        hfc = HFBackend(model.path, a.dtype, device, EngineSettings(hf_compile=True), mml)
        compile_s, rate_c = scoring(hfc, a.hf_batch)
        _, fwd_c = timed(forward_only, hfc)
        table.add(
            f"c. our HF scoring, hf_compile, batch {a.hf_batch} / floor",
            f"{rate_c / floor:.1%} ({rate_c:,.0f} tokens/s; first call with compiling {compile_s:.1f} s)",
        )
        table.add("c. HF compiled forward pass alone / floor", f"{n_tok / fwd_c / floor:.1%} ({n_tok / fwd_c:,.0f} tokens/s)")
        del hfc
        if device == "cuda":
            torch.cuda.empty_cache()

    # b: one cold vLLM engine (the yardstick for d), our path on it, then a bare LLM.generate in this process
    if parts & {"vllm", "forum"}:
        load = LoadRequest(
            "vllm", model.path, a.dtype, device, EngineSettings(tensor_parallel_size=1, pipeline_parallel_size=1), mml
        )

        def start_one():
            with pool.lease([load]) as lease:
                return lease.host(load)

        worker, start_s = timed(start_one)
        table.add("b. one vLLM engine start (cold, own process, eager)", f"{start_s:.1f} s")
    if "vllm" in parts:
        worker.score(seqs[:2], 5)
        _, ours_v = timed(worker.score, seqs, 5)
    pool.shutdown_all()
    if "vllm" in parts:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw = {"kv_cache_memory_bytes": 1 << 30} if device == "cpu" else {"gpu_memory_utilization": 0.3}
        llm = LLM(model=model.path, dtype=a.dtype, max_model_len=mml, max_logprobs=5, enforce_eager=True, **kw)
        sp = SamplingParams(prompt_logprobs=5, max_tokens=1, temperature=0.0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]
        llm.generate(prompts[:2], sp, use_tqdm=False)
        _, bare = timed(llm.generate, prompts, sp, use_tqdm=False)
        llm.llm_engine.engine_core.shutdown()
        del llm
        table.add("b. bare LLM.generate(prompt_logprobs=5)", f"{n_tok / bare:,.0f} tokens/s")
        table.add("b. our vLLM path (worker, parse)", f"{n_tok / ours_v:,.0f} tokens/s")
        table.add("b. ratio ours / bare (time)", f"{ours_v / bare:.2f}x")

    # d: the forum sentence, three dtypes, cold then warm; then P x L x 3 dtypes, first and cached
    store = Store(work / "home")
    if "forum" in parts:
        forum = RunSpec(texts=(SEED_TEXT,), model=model.path, dtypes=DTYPES)
        runs1, first1 = timed(compare, forum, store=store)
        table.add("d. forum sentence x 3 dtypes, cold engines", f"{first1:.1f} s = {first1 / start_s:.2f}x one engine start")
        for run in runs1:
            for b in ("vllm", "hf"):
                t = getattr(run.meta.env, f"{b}_engine")["load_timing"]
                table.add(
                    f"d. ... {b} {run.dtype} engine",
                    f"imports {t['import_s']} s, load {t['init_s']} s, waited {run.meta.timing[f'{b}_load_s']} s",
                )
        _, warm1 = timed(compare, forum, store=store, use_cache=False)
        table.add("d. the same again, warm engines, recomputed", f"{warm1:.3f} s")
        pool.shutdown_all()
    if "set" in parts:
        texts = tuple(tok.decode(s[1:] if s[0] == tok.bos_token_id else s) for s in seqs)
        spec = RunSpec(texts=texts, model=model.path, dtypes=DTYPES)
        runs, first = timed(compare, spec, store=store)
        table.add(f"d. compare {a.prompts}x{a.tokens} tokens x 3 dtypes, first (engine starts included)", f"{first:.1f} s")
        _, cached = timed(compare, spec, store=store)
        table.add("d. the same, cached", f"{cached:.3f} s")
        pool.shutdown_all()
        # e: what the dashboard pays to reopen it
        times = [timed(store.load, runs[0].run_id)[1] for _ in range(5)]
        n_pos = sum(len(s.token_ids) for s in runs[0].sequences)
        table.add(f"e. reopen a stored run ({n_pos} positions)", f"{statistics.median(times) * 1000:.0f} ms (median of 5)")
    print("\n" + table.text())


if __name__ == "__main__":
    main()
