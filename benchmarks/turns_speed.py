"""Engines in turn: a comparison of a model whose two engines do not fit together under a memory cap.

    python benchmarks/turns_speed.py [--model llama8b|qwen3_30b_a3b|qwen3_32b|PATH] [--layers N] [--cap 80GB]
        [--prompts 1000] [--tokens 1024] [--dtype bfloat16] [--hf-batch 8] [--spool 16GB] [--rollout 64x4x512] [--out FILE]

What it measures, on one device:
  in turn   `compare` of P x L tokens with the exact KL under the cap (device_memory): wall time, the
            engines' turns, the most the spool held, the largest memory in use on the card
            (nvidia-smi, every process) and in /dev/shm (where the spool's rows live).
  bare      each engine's plain call on the same ids, timed inside its host, one engine at a time
            (vLLM's prompt_logprobs generate, HF's batched forward with its float32 log_softmax):
            the target is in turn <= 1.5x their sum, sleeps and wake-ups included.
  rollout   (--rollout PxSxT) a rollout in turn: vLLM samples, sleeps, HF scores.
Models: the shapes of benchmarks/shapes.py with random weights (--layers cuts their depth so they
fit a machine's disk), built with the demo model's tokenizer. Results go to --out as they come.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class Peak:
    """The largest value of `read()` while the `with` block runs, sampled every 0.1 s."""

    def __init__(self, read):
        self.read, self.peak, self.top, self._stop = read, 0, 0, threading.Event()

    def __enter__(self):
        self.base = self.top = self.read()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            now = self.read()
            self.peak, self.top = max(self.peak, now - self.base), max(self.top, now)
            time.sleep(0.1)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def gpu_used() -> int:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    out = subprocess.run(
        [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], check=False, capture_output=True, text=True
    )
    return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else 0


def shm_used() -> int:
    try:
        u = shutil.disk_usage("/dev/shm")  # where the spool's rows go
    except OSError:
        return 0
    return u.used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cap", default="80GB")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--spool", default=None, help="LPP_SPOOL_BYTES (default 16GB)")
    ap.add_argument("--rollout", default=None, help="PxSxT: P prompts x S samples x T new tokens, in turn")
    ap.add_argument("--no-compare", action="store_true", help="only the rollout (a 10-minute call holds one part)")
    ap.add_argument(
        "--bare", default=None, help="V,H: the bare engines' seconds measured by an earlier run on the same card (skips them)"
    )
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the shapes (default: the demo model's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-turns-"))
    if a.spool:
        os.environ["LPP_SPOOL_BYTES"] = a.spool

    from transformers import AutoTokenizer

    from benchmarks.engines import Table, prompts_of
    from benchmarks.shapes import SHAPES, build_shape
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.analysis.turns import fit_of
    from logprob_parity.engines import memory, pool
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    work = Path(a.build_dir or tempfile.mkdtemp(prefix="lpp-turns-"))
    tok_path = a.tokenizer or resolve_model(None).path
    t = time.perf_counter()
    name = {"llama8b": "llama3_8b"}.get(a.model, a.model)
    if name in SHAPES:
        folder = work / (f"{name}-shape" + (f"-{a.layers}l" if a.layers else ""))
        model = resolve_model(build_shape(name, folder, tok_path, device, a.layers))
    else:
        model = resolve_model(a.model)
    built = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(model.path)
    v = versions()
    out = Path(a.out) if a.out else REPO / "benchmarks" / "results" / f"turns_{a.model}_{device}.md"
    table = Table(
        out,
        f"Device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {model.name} ({memory.param_count(model.path) / 1e9:.1f}B parameters, {model.vocab_size:,}-entry vocabulary) · "
        f"{a.dtype} · cap {a.cap} · hf_batch_size {a.hf_batch} · `python benchmarks/turns_speed.py {' '.join(sys.argv[1:])}`",
    )
    table.add("model built (random weights, saved) or found", f"{built:.1f} s")
    settings = EngineSettings(hf_batch_size=a.hf_batch, device_memory=a.cap)
    seqs = prompts_of(tok, a.prompts, a.tokens)
    texts = tuple(tok.decode(s[1:] if s and s[0] == tok.bos_token_id else s) for s in seqs)
    spec = RunSpec(texts=texts, model=model.path, dtypes=(a.dtype,), device=device, settings=settings)
    store = Store(work / "home")
    p = prepare(spec, Context.of(store=store))
    vreq, hreq = p.load("vllm", a.dtype), p.load("hf", a.dtype)
    fit = fit_of(p, vreq, hreq)
    table.add("plan", fit.words)

    if not a.no_compare:
        in_turn_compare(a, p, spec, store, vreq, hreq, table)
    if a.rollout:
        in_turn_rollout(a, tok, model, device, settings, store, table)
    pool.POOL.shutdown()


def in_turn_compare(a, p, spec, store, vreq, hreq, table) -> None:
    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import Context
    from logprob_parity.engines import pool

    given = "" if a.bare is None else " (given: measured by an earlier run of this script on the same card)"
    if a.bare is not None:  # a 10-minute call that cannot hold the bare engines and the run in turn
        bare_v, bare_h = (float(x) for x in a.bare.split(","))
    else:  # bare: each engine alone on the same ids (warm: each is used once first)
        with pool.POOL.lease_for([vreq, hreq], True) as lease:
            vh, hh = lease.host(vreq), lease.host(hreq)
            vh.call("bare_prefill", p.seqs[:2], spec.top_k, True)
            bare_v = vh.call("bare_prefill", p.seqs, spec.top_k, True)
            hh.call("bare_forward", p.seqs[:2], a.hf_batch, spec.top_k)
            bare_h = hh.call("bare_forward", p.seqs, a.hf_batch, spec.top_k)
    table.add("bare vLLM prefill (prompt_logprobs, in its host)", f"{bare_v:.2f} s{given}")
    table.add("bare HF forward (float32 log_softmax, target, top k, in its host)", f"{bare_h:.2f} s{given}")

    with Peak(gpu_used) as g, Peak(shm_used) as s:
        t = time.perf_counter()
        (run,) = compare(spec, Context.of(store=store, on_event=said), use_cache=False)
        took = time.perf_counter() - t
    tm = run.meta.timing
    n = run.summary["n_tokens"]
    table.add("in turn: positions compared", f"{n:,} ({a.prompts} x {a.tokens} tokens)")
    table.add("in turn: compare with the exact KL, wall", f"{took:.2f} s ({n / took:,.0f} tokens/s)")
    table.add("in turn: / (bare vLLM + bare HF), target <= 1.5", f"{took / (bare_v + bare_h):.2f}x")
    loads = float(tm.get("vllm_load_s", 0.0)) + float(tm.get("hf_load_s", 0.0))
    if loads:  # fresh engines (--bare): the bare seconds exclude loading, which a side-by-side run pays too
        table.add(
            "in turn: less the two engines' loads, / (bare vLLM + bare HF)",
            f"{took - loads:.2f} s: {(took - loads) / (bare_v + bare_h):.2f}x (loads {loads:.1f} s)",
        )
    table.add("in turn: turns, groups' batches", f"{tm.get('turns')} turns, {tm.get('batches')} batches")
    table.add("in turn: exact KL", run.meta.env.vllm_engine.get("kl_full", ""))
    table.add(
        "in turn: spool, most held / bound (target <= 16 GB)",
        f"{tm.get('spool_bytes_max', 0) / 1e9:.2f} GB / {tm.get('spool_bound_bytes', 0) / 1e9:.2f} GB",
    )
    table.add("in turn: most memory in use on the card (every process)", f"{g.top / 1e9:.2f} GB (cap {a.cap})")
    table.add("in turn: the run's own timing (s)", ", ".join(f"{k} {x}" for k, x in tm.items() if isinstance(x, float)))
    table.add("in turn: most /dev/shm in use above its start", f"{s.peak / 1e9:.2f} GB")
    table.add("in turn: mean |Δ|, KL mean", f"{run.summary['mean_abs_delta']:.4g}, {run.summary.get('kl_full_mean')}")


def said(stage: str, dtype: str | None, detail: str) -> None:
    """The run's progress on stdout, with the time: a 10-minute call cut short still shows where it stood."""
    print(f"{time.strftime('%H:%M:%S')} [{stage}{'/' + dtype if dtype else ''}] {detail}", flush=True)


def in_turn_rollout(a, tok, model, device, settings, store, table) -> None:
    from benchmarks.engines import prompts_of
    from logprob_parity.analysis.request import Context
    from logprob_parity.analysis.rollout import rollout
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import Sampling

    n_p, n_s, n_t = (int(x) for x in a.rollout.split("x"))
    sampling = Sampling(samples=n_s, temperature=1.0, max_tokens=n_t, seed=0)
    r_texts = tuple(tok.decode(s[1:]) for s in prompts_of(tok, n_p, 128))
    with Peak(gpu_used) as g:
        t = time.perf_counter()
        (ro,) = rollout(
            RunSpec(texts=r_texts, model=model.path, dtypes=(a.dtype,), device=device, settings=settings),
            sampling,
            Context.of(store=store, on_event=said),
            use_cache=False,
        )
        took = time.perf_counter() - t
    toks = sum(len(x.completion_token_ids) for x in ro.samples)
    table.add(
        f"rollout in turn: {n_p} prompts x {n_s} samples x {n_t} tokens, wall", f"{took:.1f} s ({toks:,} completion tokens)"
    )
    table.add(
        "rollout in turn: turns; timing",
        f"{ro.meta.timing.get('turns')}; " + ", ".join(f"{k} {x:.1f}" for k, x in ro.meta.timing.items() if k.endswith("_s")),
    )
    table.add("rollout in turn: most memory in use on the card", f"{g.top / 1e9:.2f} GB (cap {a.cap})")
    table.add("rollout in turn: exact KL", ro.meta.env.vllm_engine.get("kl_full", ""))


if __name__ == "__main__":
    main()
