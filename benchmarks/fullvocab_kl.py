"""The exact full-vocabulary KL(HF || vLLM) at every position, end to end: tokens a second.

llm-compressor's maintainers measured 1.1 tokens/s pulling full-vocabulary logprobs through vLLM's
public API (a Python object per vocabulary entry). Ours never builds those objects (see
logprob_parity/engines/fullvocab.py). Target on the H200, TinyLlama-shaped 1.1B model, 64 x 512 tokens,
bfloat16: at least 1,000 tokens/s.

    python benchmarks/fullvocab_kl.py [--model tinyllama|demo|PATH] [--tokenizer PATH] [--prompts 64] [--tokens 512] [--dtype bfloat16] [--out FILE]

Measured, on warm engines (both started and used once before any timing):
  - `compare` with the exact KL (vLLM prefill leaving its full rows, HF scoring and summing the KL,
    metrics): the end-to-end rate, the target's number;
  - the same `compare` without it (LPP_FULL_KL_MAX_BYTES below the run's size), so the KL's own
    cost is the difference;
and, for the record, the engines' start and the run's KL statistics.
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

TARGET = 1000.0  # tokens/s
API_RATE = 1.1  # tokens/s, llm-compressor's measurement through vLLM's public API


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tinyllama", help="tinyllama (random 1.1B), demo, or a folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for tinyllama (default: the demo model's)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # 64 x 511 rows of a 49,152-entry vocabulary are 6.4 GB of float32: above the default cap
    os.environ.setdefault("LPP_FULL_KL_MAX_BYTES", str(64 << 30))
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-kl-bench-"))

    from transformers import AutoTokenizer

    from benchmarks.engines import Table, build_tinyllama, prompts_of
    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines import fullvocab, pool
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    work = Path(tempfile.mkdtemp(prefix="lpp-kl-bench-"))
    if a.model == "tinyllama":
        t = time.perf_counter()
        model = resolve_model(build_tinyllama(work / "tinyllama-1.1b-random", a.tokenizer or resolve_model(None).path, device))
        built = time.perf_counter() - t
    else:
        model, built = resolve_model(None if a.model == "demo" else a.model), None
    tok = AutoTokenizer.from_pretrained(model.path)
    seqs = prompts_of(tok, a.prompts, a.tokens)
    texts = tuple(tok.decode(s[1:] if s and s[0] == tok.bos_token_id else s) for s in seqs)
    v = versions()
    out = Path(a.out) if a.out else REPO / "benchmarks" / "results" / f"fullvocab_kl_{device}.md"
    table = Table(
        out,
        f"Device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {model.name} ({model.vocab_size:,}-entry vocabulary) · {a.prompts} prompts x {a.tokens} tokens · "
        f"{a.dtype} · {os.cpu_count()} CPU cores · `python benchmarks/fullvocab_kl.py {' '.join(sys.argv[1:])}`",
    )
    if built is not None:
        table.add("model built (random weights, saved)", f"{built:.1f} s")
    store = Store(work / "home")
    spec = RunSpec(texts=texts, model=model.path, dtypes=(a.dtype,), device=device)
    t = time.perf_counter()
    compare(RunSpec(texts=texts[:2], model=model.path, dtypes=(a.dtype,), device=device), store=store, use_cache=False)
    table.add("engines started and used once (two texts)", f"{time.perf_counter() - t:.1f} s")

    t = time.perf_counter()
    (run,) = compare(spec, store=store, use_cache=False)
    took = time.perf_counter() - t
    n = run.summary["n_tokens"]
    assert run.meta.env.vllm_engine["kl_full"].startswith("exact"), run.meta.env.vllm_engine["kl_full"]
    rate = n / took
    table.add(
        "positions with the exact KL",
        f"{n:,} ({run.meta.env.vllm_engine['kl_full']}); {n * model.vocab_size * 4 / 1e9:.1f} GB of float32 full rows",
    )
    table.add(
        "**compare with the exact KL, end to end**",
        f"**{took:.2f} s = {rate:,.0f} tokens/s** (target {TARGET:,.0f}: {'met' if rate >= TARGET else 'NOT met'}; "
        f"{rate / API_RATE:,.0f}x the 1.1 tokens/s through vLLM's public API)",
    )
    table.add("... of it vLLM scoring (prefill, full rows written)", f"{run.meta.timing['vllm_score_s']:.2f} s")
    table.add("... of it HF scoring (reading the rows, KL in float64)", f"{run.meta.timing['hf_score_s']:.2f} s")
    s = run.summary
    table.add(
        "exact KL: mean ± err, median, 99.9th pct, max",
        f"{s['kl_full_mean']:.4e} ± {s['kl_full_mean_err']:.1e}, {s['kl_full_p50']:.4e}, {s['kl_full_p99_9']:.4e}, "
        f"{s['kl_full_max']:.4e}",
    )
    table.add(
        "same top token, PPL(vLLM)/PPL(HF), Δp RMS",
        f"{s['same_top_p']:.4f} ± {s['same_top_p_err']:.4f}, {s['ppl_ratio']:.6f}, {s['dp_rms']:.3e}",
    )

    fullvocab.MAX_BYTES = 0  # the same comparison without the exact KL: the KL's own cost is the difference
    t = time.perf_counter()
    (plain,) = compare(spec, store=store, use_cache=False)
    took0 = time.perf_counter() - t
    assert plain.summary["kl_full_mean"] is None
    table.add(
        "the same compare without the exact KL",
        f"{took0:.2f} s = {n / took0:,.0f} tokens/s; the exact KL costs "
        f"{took - took0:.2f} s ({(took - took0) / took:.0%} of the run)",
    )
    pool.shutdown_all()
    print("\n" + table.text())


if __name__ == "__main__":
    main()
