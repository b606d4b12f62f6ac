"""A comparison at the engines' own speed, with and without the exact KL, at production scale.

    python benchmarks/compare_speed.py [--model tinyllama|llama8b|PATH] [--tokenizer PATH] [--prompts 64] [--tokens 512]
        [--dtype bfloat16] [--hf-batch 32] [--parts speed,long,set] [--long-tokens 32000] [--set 1000x2048] [--out FILE]

Parts, on warm engines (each started and used once before any timing):
  speed  `compare` of P x L tokens without the exact KL and with it, against the bare engines on the
         same ids: one plain `LLM.generate(prompt_logprobs=k)` in our vLLM host plus one plain batched
         HF forward (float32 log_softmax, the target's logprob, the top k) in our HF host, both timed
         inside the host (no socket, no parsing). Targets: compare <= 1.5x bare; with the exact KL
         <= 1.25x without it; with it >= 20,000 tokens/s on the 1.1B shape (H200).
  long   one text of --long-tokens tokens, end to end with the exact KL at every position, and the
         token view of its worst window drawn (the page's cost for a long text).
  set    N x L tokens (--set) with the exact KL at every position, in batches: tokens/s, batches,
         and this process's peak memory.
Models: tinyllama is TinyLlama-1.1B's shape, llama8b Llama-3.1-8B's (128,256-entry vocabulary),
and the other families' shapes of benchmarks/shapes.py (qwen3_8b, gemma2_9b, qwen3_30b_a3b; --layers
cuts their depth), all random weights with the demo model's tokenizer (its ids are a subset of the
vocabulary), built here (--build-dir keeps them between runs). An MoE model's speed part also reports
its routing keys and the share of the gap that routing replay removes, on --replay-texts texts. Results go to --out as they come (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGETS = {"ratio": 1.5, "kl_ratio": 1.25, "kl_rate_1b": 20000.0}


def build_llama8b(out: Path, tokenizer_path: str, device: str) -> str:
    """Random weights (std 0.02) in bfloat16 with Llama-3.1-8B's config, saved as a plain HF folder."""
    from benchmarks.shapes import build_shape

    return build_shape("llama3_8b", out, tokenizer_path, device)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def replay_share(run, seqs, vh, hh) -> dict:
    """The gap to vLLM on these texts before and after routing replay (HF scored again with vLLM's
    expert ids forced): the share of it that routing explains (logprob_parity.analysis.diagnostics)."""
    from logprob_parity.analysis.floors import gap

    v_routes = vh.routes(seqs)
    if isinstance(v_routes, str):
        return {"why": v_routes}
    base_v = [s.vllm.logprob for s in run.sequences[: len(seqs)]]
    before = gap(base_v, [s.hf.logprob for s in run.sequences[: len(seqs)]])
    after = gap(base_v, hh.replay_score(seqs, v_routes))
    return {
        "texts": len(seqs),
        "before": before["mean"],
        "after": after["mean"],
        "share": 1 - after["mean"] / before["mean"],
        "max_before": before["max"],
        "max_after": after["max"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", default="tinyllama", help="tinyllama (random 1.1B), llama8b (random 8B, 128k vocabulary), demo, or a folder"
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the random models (default: the demo model's)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=32, help="hf_batch_size of our HF engine and of the bare forward")
    ap.add_argument("--parts", default="speed", help="speed,long,set")
    ap.add_argument("--long-tokens", type=int, default=32000)
    ap.add_argument("--set", default="1000x2048", help="N x L of the set part")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each speed measurement (the median is reported)")
    ap.add_argument("--layers", type=int, default=None, help="a shape of benchmarks/shapes.py cut to this many layers")
    ap.add_argument("--attn", default=None, help="HF's attn_implementation (Gemma 2's soft-cap needs eager)")
    ap.add_argument("--build-dir", default=None, help="where the random shapes are built and kept")
    ap.add_argument("--replay-texts", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    os.environ.setdefault("LOGPROB_PARITY_HOME", tempfile.mkdtemp(prefix="lpp-speed-"))
    # The GPU machine's setup script turns the tokenizers' threads off for every process there; `lpp`
    # and the dashboard leave the library's default (a batch encoded on every core), and the engine
    # hosts turn them off for themselves (logprob_parity.engines.host). Measure this process as a user runs it.
    if os.environ.get("TOKENIZERS_PARALLELISM") == "false" and not os.environ.get("LPP_KEEP_TOKENIZERS_SERIAL"):
        del os.environ["TOKENIZERS_PARALLELISM"]

    import statistics

    from transformers import AutoTokenizer

    from benchmarks.engines import Table, build_tinyllama, prompts_of
    from logprob_parity.analysis import request as request_mod
    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.engines import fullvocab, pool
    from logprob_parity.env import device_name, resolve_device, versions
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    device = resolve_device("auto")
    work = Path(tempfile.mkdtemp(prefix="lpp-speed-"))
    from benchmarks.shapes import SHAPES, build_shape

    tok_path = a.tokenizer or (resolve_model(None).path if a.model in ("tinyllama", "llama8b", *SHAPES) else a.model)
    t = time.perf_counter()
    if a.model == "tinyllama":
        model = resolve_model(build_tinyllama(work / "tinyllama-1.1b-random", tok_path, device))
    elif a.model == "llama8b":
        model = resolve_model(build_llama8b(work / "llama-3.1-8b-shape-random", tok_path, device))
    elif a.model in SHAPES:
        where = Path(a.build_dir) if a.build_dir else work
        name = f"{a.model}-shape" + (f"-{a.layers}l" if a.layers else "")
        model = resolve_model(build_shape(a.model, where / name, tok_path, device, a.layers))
    else:
        model = resolve_model(None if a.model == "demo" else a.model)
    built = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(model.path)
    v = versions()
    out = Path(a.out) if a.out else REPO / "benchmarks" / "results" / f"compare_speed_{a.model}_{device}.md"
    table = Table(
        out,
        f"Device {device_name(device)} · torch {v['torch']} · transformers {v['transformers']} · vLLM {v['vllm']} · "
        f"model {model.name} ({model.vocab_size:,}-entry vocabulary) · {a.dtype} · hf_batch_size {a.hf_batch} · "
        f"{os.cpu_count()} CPU cores · `python benchmarks/compare_speed.py {' '.join(sys.argv[1:])}`",
    )
    table.add("model built (random weights, saved) or found", f"{built:.1f} s")
    settings = dataclasses.replace(EngineSettings(), hf_batch_size=a.hf_batch, attn_implementation=a.attn)
    store = Store(work / "home")

    def texts_of(n: int, length: int) -> tuple[str, ...]:
        seqs = prompts_of(tok, n, length)
        return tuple(tok.decode(s[1:] if s and s[0] == tok.bos_token_id else s) for s in seqs)

    def run(texts: tuple[str, ...], kl: bool, floor: bool = True):
        fullvocab.ENABLED = kl
        try:
            t = time.perf_counter()
            (r,) = compare(
                RunSpec(texts=texts, model=model.path, dtypes=(a.dtype,), device=device, settings=settings, noise_floor=floor),
                store=store,
                use_cache=False,
            )
            return r, time.perf_counter() - t
        finally:
            fullvocab.ENABLED = True

    if "speed" in parts:
        texts = texts_of(a.prompts, a.tokens)
        t = time.perf_counter()
        run(texts[:2], True)
        table.add(f"speed: engines started and used once (two texts of {a.tokens} tokens)", f"{time.perf_counter() - t:.1f} s")
        plain_t, kl_t, bare_t, plain, with_kl, barest = [], [], [], None, None, None
        for _ in range(a.repeats):
            barest, took = run(texts, False, floor=False)
            bare_t.append(took)
            plain, took = run(texts, False)
            plain_t.append(took)
            with_kl, took = run(texts, True)
            kl_t.append(took)
        n = plain.summary["n_tokens"]
        assert with_kl.meta.env.vllm_engine["kl_full"].startswith("exact"), with_kl.meta.env.vllm_engine["kl_full"]
        # the bare engines: the same hosts, the same ids, their plain calls timed inside them
        spec = RunSpec(texts=texts, model=model.path, dtypes=(a.dtype,), device=device, settings=settings)
        p = prepare(spec, Context.of(store=store))
        vreq, hreq = p.load("vllm", a.dtype), p.load("hf", a.dtype)
        with pool.POOL.lease([vreq, hreq]) as lease:
            vh, hh = lease.host(vreq), lease.host(hreq)
            vh.call("bare_prefill", p.seqs, spec.top_k, True)
            hh.call("bare_forward", p.seqs, a.hf_batch, spec.top_k)
            bare_v = [min(vh.call("bare_prefill", p.seqs, spec.top_k, flat) for flat in (True, False)) for _ in range(a.repeats)]
            bare_h = [hh.call("bare_forward", p.seqs, a.hf_batch, spec.top_k) for _ in range(a.repeats)]
            replay = None
            if with_kl.meta.routing.get("measured"):
                try:
                    replay = replay_share(with_kl, p.seqs[: a.replay_texts], vh, hh)
                except Exception as exc:  # the speed rows are still written; the table says why replay is missing
                    replay = {"why": f"{type(exc).__name__}: {str(exc)[:300]}"}
        med = statistics.median
        bare = med(bare_v) + med(bare_h)
        t_plain, t_kl, t_bare = med(plain_t), med(kl_t), med(bare_t)
        spread = lambda xs: f"{min(xs):.3f}-{max(xs):.3f} s"  # noqa: E731
        table.add("speed: positions compared", f"{n:,} ({a.prompts} x {a.tokens} tokens)")
        table.add(
            "speed: bare vLLM prefill (prompt_logprobs=5, in our host, faster of flat/list logprobs)",
            f"{med(bare_v):.3f} s (of {a.repeats}: {spread(bare_v)})",
        )
        table.add(
            f"speed: bare HF forward (batch {a.hf_batch}, float32 log_softmax, target, top 5, in our host)",
            f"{med(bare_h):.3f} s (of {a.repeats}: {spread(bare_h)})",
        )
        table.add(
            "**speed: compare without the exact KL and without the noise floor**",
            f"**{t_bare:.3f} s = {n / t_bare:,.0f} tokens/s = {t_bare / bare:.2f}x bare** (target <= {TARGETS['ratio']}x: "
            f"{'met' if t_bare / bare <= TARGETS['ratio'] else 'NOT met'}; of {a.repeats}: {spread(bare_t)})",
        )
        tm = barest.meta.timing
        table.add(
            "  of it vLLM / HF scoring (host round trips included) / the rest in this process",
            f"{tm['vllm_score_s']:.3f} s / {tm['hf_score_s']:.3f} s / {bare_t[-1] - tm['vllm_score_s'] - tm['hf_score_s']:.3f} s "
            f"(the last repeat, {bare_t[-1]:.3f} s)",
        )
        table.add(
            "**speed: the same with its noise floor (the default)**",
            f"**{t_plain:.3f} s = {t_plain / t_bare:.2f}x without it** (target <= 1.3x: {'met' if t_plain / t_bare <= 1.3 else 'NOT met'}; "
            f"the floor's engine time {plain.meta.timing.get('noise_s', 0):.3f} s, beside the table; of {a.repeats}: {spread(plain_t)})",
        )
        fl = plain.meta.noise
        table.add(
            "  the floor (HF's variations, on its sample of the texts)",
            f"{plain.summary.get('noise_texts')} text(s), {plain.summary.get('noise_tokens')} tokens; HF {fl.get('seconds', {}).get('hf', 0):.3f} s, "
            f"vLLM {fl.get('seconds', {}).get('vllm', 0):.3f} s; "
            + "; ".join(f"{k} {v['mean']:.3e}" for k, v in (fl.get("variations") or {}).items())
            + f"; set by {plain.summary.get('noise_set_by')}",
        )
        table.add(
            "**speed: compare with the exact KL at every position**",
            f"**{t_kl:.3f} s = {n / t_kl:,.0f} tokens/s = {t_kl / t_plain:.2f}x the same without it** (target <= {TARGETS['kl_ratio']}x: "
            f"{'met' if t_kl / t_plain <= TARGETS['kl_ratio'] else 'NOT met'}; of {a.repeats}: {spread(kl_t)}; "
            f"{with_kl.meta.env.vllm_engine['kl_full']}, {with_kl.meta.env.vllm_engine.get('kl_transport')})",
        )
        tk = with_kl.meta.timing
        table.add(
            "  of it vLLM / HF scoring (host round trips included) / the rest in this process",
            f"{tk['vllm_score_s']:.3f} s / {tk['hf_score_s']:.3f} s / {kl_t[-1] - tk['vllm_score_s'] - tk['hf_score_s']:.3f} s "
            f"(the last repeat, {kl_t[-1]:.3f} s; its floor's engine time {tk.get('noise_s', 0):.3f} s was beside the table)",
        )
        if a.model == "tinyllama":
            rate = n / t_kl
            table.add(
                "speed: exact-KL rate against the 1.1B target",
                f"{rate:,.0f} tokens/s (target >= {TARGETS['kl_rate_1b']:,.0f}: "
                f"{'met' if rate >= TARGETS['kl_rate_1b'] else 'NOT met'})",
            )
        s = with_kl.summary
        table.add(
            "speed: exact KL mean ± err, max; same top token",
            f"{s['kl_full_mean']:.4e} ± {s['kl_full_mean_err']:.1e}, {s['kl_full_max']:.4e}; {s['same_top_p']:.4f}",
        )
        table.add(
            "speed: mean / max |Δ logp|; its level",
            f"{s['mean_abs_delta']:.4e} / {s['max_abs_delta']:.4e}; {s.get('noise_words')}",
        )
        rt = with_kl.meta.routing
        if rt.get("measured"):
            table.add(
                "routing: routers that differ (routing_flip_frac); tokens with one or more; layers per token",
                f"**{s['routing_flip_frac']:.4f}; {s['routing_tokens_flipped']:.4f}; {s['routing_layers_flipped_mean']:.3f}** "
                f"(on {rt['texts']} texts, {rt['tokens']:,} tokens, {rt['layers']} MoE layers, top-{rt['top_k']}; vLLM: {rt['vllm_from']})",
            )
            table.add(
                "routing: the compare's time reading the routes (inside the times above)",
                f"{with_kl.meta.timing.get('routing_s', float('nan')):.3f} s",
            )
        else:
            table.add("routing", rt.get("why", "not measured"))
        if replay is not None and "why" in replay:
            table.add("routing replay", f"not measured: {replay['why']}")
        elif replay is not None:
            table.add(
                f"**routing replay (HF with vLLM's experts forced, R3's rule), first {replay['texts']} texts**",
                f"**mean |Δ logp| {replay['before']:.4e} -> {replay['after']:.4e}: replay removes {replay['share']:.0%} of the gap** "
                f"(max {replay['max_before']:.4e} -> {replay['max_after']:.4e})",
            )
    if "long" in parts or "set" in parts:
        # one engine pair for both parts: the longest text's max_model_len for every request here
        longest = max(a.long_tokens if "long" in parts else 0, int(a.set.split("x")[1]) if "set" in parts else 0)
        fixed = request_mod.model_max_len(longest, model.max_positions)
        request_mod.model_max_len = lambda n, m, fixed=fixed: fixed  # type: ignore[assignment]
    if "long" in parts:
        (text,) = texts_of(1, a.long_tokens)
        t = time.perf_counter()
        run(texts_of(1, 64), True)
        table.add(f"long: engines for {fixed:,}-token contexts started and used once", f"{time.perf_counter() - t:.1f} s")
        r, took = run((text,), True)
        n = r.summary["n_tokens"]
        import numpy as np

        kl = r.sequences[0].metrics.kl_full[1:]
        table.add(
            f"**long: one {n + 1:,}-token text with the exact KL**",
            f"**{took:.1f} s = {n / took:,.0f} tokens/s; exact KL at {int(np.isfinite(kl).sum()):,} of {n:,} positions** "
            f"({r.meta.env.vllm_engine['kl_full']}); {n * model.vocab_size * 4 / 1e9:.1f} GB of float32 rows; "
            f"mean |Δ logp| {r.summary['mean_abs_delta']:.3e}, KL mean {r.summary['kl_full_mean']}",
        )
        from logprob_parity.present.render import token_view_html, windows

        back = store.load(r.run_id)
        t = time.perf_counter()
        parts_w = windows([back], 0, 512)
        html = token_view_html([back], 0, window=parts_w[0][:2])
        table.add(
            "long: reopen and draw its worst 512-token window (the page's token view)",
            f"{time.perf_counter() - t:.2f} s ({len(parts_w)} windows, {len(html) / 1e6:.1f} MB of HTML)",
        )
    if "set" in parts:
        n_set, l_set = (int(x) for x in a.set.split("x"))
        texts = texts_of(n_set, l_set)
        t = time.perf_counter()
        run(texts[:2], True)
        table.add("set: engines ready", f"{time.perf_counter() - t:.1f} s")
        r, took = run(texts, True)
        n = r.summary["n_tokens"]
        table.add(
            f"**set: {n_set:,} x {l_set:,} tokens with the exact KL**",
            f"**{took:.1f} s = {n / took:,.0f} tokens/s; {r.meta.timing['batches']} batches; exact KL "
            f"{'at every position' if r.summary['kl_full_mean'] is not None else 'MISSING: ' + r.meta.env.vllm_engine['kl_full']}**; "
            f"{n * model.vocab_size * 4 / 1e12:.2f} TB of float32 rows in all; peak memory of this process {peak_rss_gb():.2f} GB",
        )
        s = r.summary
        if s["kl_full_mean"] is not None:
            table.add(
                "set: exact KL mean ± err, p99, max",
                f"{s['kl_full_mean']:.4e} ± {s['kl_full_mean_err']:.1e}, {s['kl_full_p99']:.4e}, {s['kl_full_max']:.4e}",
            )
    pool.shutdown_all()
    print("\n" + table.text())


if __name__ == "__main__":
    main()
