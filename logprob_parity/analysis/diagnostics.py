"""Beyond "here is the difference": is it more than the noise, which knob moves it, which side is
closer to a float64 reference, and does it change a downstream answer?

Everything runs on the same token ids as the comparison, on the warm engines where possible.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from functools import partial
from importlib import resources
from typing import Any

import numpy as np

from logprob_parity.analysis import turns
from logprob_parity.analysis.compare import compare, compare_prepared
from logprob_parity.analysis.floors import VARIATIONS, floor_of, gap, hf_variations, variation_when
from logprob_parity.analysis.request import Context, EventFn, prepare
from logprob_parity.analysis.rollout import INCREMENTAL_TOKENS
from logprob_parity.analysis.verdict import closer_to_reference, diagnosis_verdicts
from logprob_parity.engines.attention import soft_caps_attention
from logprob_parity.engines.host import start_words
from logprob_parity.env import device_name, versions
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import RunSpec, content_hash
from logprob_parity.inputs.tokens import tokenize
from logprob_parity.results.records import DiagnosticsResult, DtypeDiagnosis
from logprob_parity.results.run import Run
from logprob_parity.results.store import Store

PARTS = ("noise", "reference", "downstream", "ablation", "layers")
FILLER_PROMPTS = 6  # other prompts batched beside the user's, for batch-composition noise
TRAINER_CHUNK = 64  # tokens a forward through HF's KV cache, as a trainer scoring in chunks
INCREMENTAL_WHOLE = 512  # texts up to this long are scored one token a forward from their start
REFERENCE_DTYPE = "float64"


def _data_lines(name: str) -> list[str]:
    return resources.files("logprob_parity").joinpath("data").joinpath(name).read_text(encoding="utf-8").splitlines()


def _lp(scores: list[Any]) -> list[np.ndarray]:
    return [s.logprob for s in scores]


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def ablation_knobs(device: str, slow: bool) -> list[tuple[str, dict[str, Any] | None, str]]:
    """(name, change to the settings or None when skipped, note). Only what this platform can run."""
    knobs: list[tuple[str, dict[str, Any] | None, str]] = [
        ("vLLM prefix caching on", {"enable_prefix_caching": True}, ""),
        (
            "vLLM chunked prefill, max_num_batched_tokens=32",
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 32, "max_num_seqs": 8},
            "",
        ),
        ("HF attn_implementation=eager", {"attn_implementation": "eager"}, ""),
    ]
    if device == "cuda" or slow:
        knobs.append(("vLLM torch.compile + graphs (enforce_eager off)", {"enforce_eager": False}, ""))
    else:
        knobs.append(
            (
                "vLLM torch.compile + graphs (enforce_eager off)",
                None,
                "skipped: compiling on CPU takes minutes (--slow-knobs runs it)",
            )
        )
    if device == "cuda":
        for backend in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"):
            knobs.append((f"vLLM attention_backend={backend}", {"attention_backend": backend}, ""))
        knobs.append(("TF32 matmuls (both engines)", {"tf32": True}, ""))
        knobs.append(("vLLM batch-invariant mode", {"batch_invariant": True}, ""))
    else:
        knobs.append(("vLLM attention backends", None, "skipped: vLLM's CPU build has one attention backend (CPU_ATTN)"))
        knobs.append(("HF TF32 matmuls", None, "skipped: TF32 exists on NVIDIA GPUs only"))
        knobs.append(("vLLM batch-invariant mode", None, "skipped: vLLM's batch-invariant kernels need CUDA"))
    knobs.append(("vLLM fp32 LM head", None, f"skipped: no such option in vLLM {versions()['vllm']}"))
    return knobs


def diagnose(
    spec: RunSpec,
    ctx: Context | None = None,
    parts: tuple[str, ...] = ("noise", "reference", "downstream"),
    gen_tokens: int = 16,
    slow_knobs: bool = False,
    layer_text: int = 0,
    *,
    store: Store | None = None,
    on_event: EventFn | None = None,
    model_roots: list[str] | None = None,
) -> DiagnosticsResult:
    """Run the chosen diagnostics for every dtype of the spec, store the result and return it.

    It goes through the same request path as `compare` (ctx: the store, the allowed model roots,
    the progress callback), so a page that offers diagnostics applies the server's model-root rules.
    """
    ctx = ctx or Context.of(store=store, on_event=on_event, model_roots=model_roots)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise UserError(f"unknown diagnostic(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    p = prepare(spec, ctx)  # refuses a model outside the allowed roots before anything runs
    every = [p.load(b, d) for d in p.spec.dtypes for b in ("vllm", "hf")]
    fits = {d: turns.fit_of(p, p.load("vllm", d), p.load("hf", d), keep=every) for d in p.spec.dtypes}
    if "layers" in parts and any(f.in_turn for f in fits.values()):
        raise UserError(
            "the layer part compares vLLM's and HF's vectors of every layer at once, so both engines must hold the "
            f"device together; here they cannot: {next(f.words for f in fits.values() if f.in_turn)}. Leave the layer "
            "part out, or raise the memory cap."
        )
    base_runs = compare_prepared(p)
    tokenizer, seqs, bos = p.tokenizer, p.seqs, p.spec.bos
    filler = [list(tokenize(tokenizer, t, bos).token_ids) for t in _data_lines("sentences.txt")[:FILLER_PROMPTS]]
    mcq = _mcq_items(tokenizer, bos) if "downstream" in parts else []
    # the comparison's own max_model_len, so the warm engines of the comparison serve the diagnostics
    mml = p.max_model_len
    ctx_seqs = seqs + [f for f in filler if len(f) < mml]
    mcq = [m for m in mcq if len(m["ids"]) < mml]
    gen = min(gen_tokens, mml - len(seqs[0]) - 1)
    emit = ctx.emit

    dtypes: dict[str, DtypeDiagnosis] = {}
    picks: dict[str, dict[str, list[int]]] = {}
    replayed: dict[str, dict[str, Any]] = {}  # dtype -> the routing-replay row of the ablation (MoE models)
    for run in base_runs:
        d = run.dtype
        out: dict[str, Any] = {
            "run_id": run.run_id,
            "gap": {
                "mean": run.summary["mean_abs_delta"],
                "max": run.summary["max_abs_delta"],
                "argmax_agreement": run.summary.get("argmax_agreement"),
            },
        }
        hf_r, v_r = p.load("hf", d), p.load("vllm", d)
        # the kernel the HF engine runs: the setting, else eager for a soft-capped model (hf.soft_caps_attention), else SDPA
        own = p.spec.settings.attn_implementation or (
            "eager" if soft_caps_attention(p.model.path, p.spec.settings.trust_remote_code) else "sdpa"
        )
        other = "eager" if own != "eager" else "sdpa"
        other_r = p.load("hf", d, replace(p.spec.settings, attn_implementation=other))
        ref_r = p.load("hf", REFERENCE_DTYPE, device="cpu")
        needed = [hf_r, v_r] + ([other_r] if "noise" in parts else []) + ([ref_r] if "reference" in parts else [])
        emit("load", d, f"{len(needed)} engines for diagnostics (a cold one: {start_words('vllm', p.device)})")
        base_hf = [s.hf.logprob for s in run.sequences]
        base_v = [s.vllm.logprob for s in run.sequences]
        n = len(seqs)
        turn = partial(ctx.pool.device_turn, ctx.waiter(d))
        # in turn (a model too large for both engines at once), one engine holds the device at a time
        with ctx.pool.lease_for(needed, fits[d].in_turn, on_wait=ctx.waiter(d)) as lease:
            hf, vl = lease.host(hf_r), lease.host(v_r)
            if "noise" in parts:
                noise = _noise(p, run, lease, hf_r, other_r, v_r, seqs, filler, ctx_seqs, base_hf, base_v, emit, turn)
                out["noise"] = noise
                out["floor"] = {
                    **floor_of(noise),
                    "hf": floor_of(noise)["hf_noise_mean"],
                    "vllm": max((v["mean"] or 0.0) for k, v in noise.items() if k.startswith("vllm_")),
                    "texts": n,
                }
                out["gap"].update(_gap_bands(run, out["floor"]))
                out["ratio_to_hf_noise"] = _ratio(out["gap"]["mean"], out["floor"]["hf"])
                out["ratio_to_vllm_noise"] = _ratio(out["gap"]["mean"], out["floor"]["vllm"])
            if "reference" in parts:
                emit("reference", d, f"HF in {REFERENCE_DTYPE} on the CPU")
                ref_w = lease.host(ref_r)
                with turn(what="the float64 reference"):
                    ref = _lp(ref_w.score(seqs, 1))
                out["reference"] = _reference(base_v, base_hf, ref)
            if "layers" in parts:
                out["layers"] = _layers(hf, vl, seqs, filler, layer_text, mml, d, emit, turn)
            if "ablation" in parts:  # an MoE model: the setting-by-setting table gains routing replay
                with turn(what="routing replay"):
                    row = _replay_row(run, hf, vl, seqs, base_v, emit)
                if row is not None:
                    replayed[d] = row
            if "downstream" in parts:
                emit("downstream", d, f"greedy {gen} tokens; {len(mcq)} multiple-choice options")
                with turn(what="downstream checks"):
                    g_hf = hf.generate([seqs[0]], gen)[0] if gen > 0 else []
                    g_v = vl.generate([seqs[0]], gen)[0] if gen > 0 else []
                    mc_hf = hf.score([m["ids"] for m in mcq], 1) if mcq else []
                    mc_v = vl.score([m["ids"] for m in mcq], 1) if mcq else []
                out["greedy"] = _greedy(tokenizer, g_hf, g_v)
                picks[d] = {"hf": _mcq_picks(mcq, mc_hf), "vllm": _mcq_picks(mcq, mc_v)}
                out["mcq"] = _mcq_summary(mcq, picks[d])
        out["verdict"] = {}  # filled below, once the ablation's evidence is in
        dtypes[d] = DtypeDiagnosis.from_dict(out)
    ablation = _ablation(spec, ctx, base_runs, p.device, slow_knobs) if "ablation" in parts else []
    ablation += list(replayed.values())
    identity = {
        "model": p.model.name,
        "device": device_name(p.device),
        "versions": {k: v for k, v in versions().items() if k != "vllm_dist"},
        "texts": list(spec.texts),
        "parts": list(parts),
        "run_ids": {r.dtype: r.run_id for r in base_runs},
    }
    now = dt.datetime.now(dt.timezone.utc)
    result = DiagnosticsResult(
        diagnostics_id=content_hash(identity | {"gen": gen_tokens}),
        model=identity["model"],
        device=identity["device"],
        versions=identity["versions"],
        texts=tuple(spec.texts),
        parts=tuple(parts),
        run_ids=identity["run_ids"],
        dtypes=dtypes,
        ablation=tuple(ablation),
        mcq_dtype_flips=_dtype_flips(picks) if picks else None,
        created=now.isoformat(timespec="seconds"),
        created_ts=now.timestamp(),
    )
    # the stored verdict is the one verdict function's, over all the evidence (noise, reference, knobs)
    verdicts = diagnosis_verdicts(result)
    result = replace(result, dtypes={d: replace(o, verdict=verdicts[d].to_dict()) for d, o in dtypes.items()})
    # exactly what the store gives back (JSON round trip: no numpy scalars, no NaN)
    result = DiagnosticsResult.from_dict(json.loads(json.dumps(result.to_dict(), allow_nan=False)))
    ctx.store.save_diagnostics(result)
    return result


def _noise(
    p: Any,
    run: Run,
    lease: Any,
    hf_r: Any,
    other_r: Any,
    v_r: Any,
    seqs: list[list[int]],
    filler: list[list[int]],
    ctx_seqs: list[list[int]],
    base_hf: list[np.ndarray],
    base_v: list[np.ndarray],
    emit: Any,
    turn: Any,
) -> dict[str, dict[str, Any]]:
    """The floor's variations on every text (logprob_parity.analysis.floors; the comparison's own when
    its sample held every text: the same number on both pages), and beside the floor: vLLM against
    itself, HF one token a forward, HF's other attention kernel."""
    d, n = run.dtype, len(seqs)
    hf, vl = lease.host(hf_r), lease.host(v_r)
    own = run.meta.noise.get("variations") if run.summary.get("noise_texts") == n else None
    with turn(what="the noise floor"):
        if own:
            emit(
                "noise", d, "HF's floor: the comparison measured it on every text already (micro-batch, padding, packed, chunked)"
            )
            noise = {k: dict(v) for k, v in own.items()}
        else:
            emit("noise", d, "HF's floor on every text: micro-batch, padding side, packed, chunked through its KV cache")
            others = [f for f in filler if len(f) < p.max_model_len]
            noise, _skipped = hf_variations(hf, seqs, base_hf, others, p.device, hf_batch_size=p.spec.settings.hf_batch_size)
        emit("noise", d, "beside the floor: vLLM alone/batched/repeated; HF one token a forward")
        noise["vllm_alone_vs_batched"] = gap(_lp(vl.score(seqs, 1, None, 1)), _lp(vl.score(ctx_seqs, 1)[:n]))
        noise["vllm_repeat"] = gap(base_v, _lp(vl.score(seqs, 1)))
        tail = INCREMENTAL_TOKENS if max(map(len, seqs)) > INCREMENTAL_WHOLE else None
        inc = hf.rollout_score(seqs, [1] * n, chunk=1, tail=tail)
        noise["hf_incremental"] = gap([b[int(c["first"]) :] for b, c in zip(base_hf, inc)], [c["logprob"] for c in inc])
    other = other_r.settings.attn_implementation
    hf_other = lease.host(other_r)
    with turn(what="the noise floor"):
        noise[f"hf_attn_{other}"] = gap(base_hf, _lp(hf_other.score(seqs, 1)))
    return noise


def _layers(
    hf: Any,
    vl: Any,
    seqs: list[list[int]],
    filler: list[list[int]],
    k: int,
    mml: int,
    d: str,
    emit: Any,
    turn: Any,
) -> dict[str, Any]:
    """The layer part on one text (the k-th): both engines' layers against HF's noise and float64,
    with the routing flips on the same grid for an MoE model (logprob_parity.analysis.layers)."""
    from logprob_parity.analysis.layers import REFERENCE_WORDS, layer_part
    from logprob_parity.engines.routing import compare_routes

    if not 0 <= k < len(seqs):
        raise UserError(f"the layer part's text is number {k + 1}, and there are {len(seqs)} texts")
    ids = seqs[k]
    emit("layers", d, f"every layer of text {k + 1} ({len(ids)} tokens) on both engines, HF's own noise, and {REFERENCE_WORDS}")
    with turn(what="the layer capture"):
        routing = None
        v_routes, h_routes = vl.routes([ids]), hf.routes([ids])
        if not isinstance(v_routes, str) and not isinstance(h_routes, str):
            routing = compare_routes(np.asarray(v_routes[0]), np.asarray(h_routes[0]))
        others = [f for f in filler if len(f) < mml]
        say = partial(emit, "layers", d)
        got = layer_part({"vllm": vl, "hf": hf}, ids, others, d, routing, say)
    return {"text": k, **got}


def _gap_bands(run: Any, floor: dict[str, Any]) -> dict[str, Any]:
    """The comparison's band counts against this diagnosis's own noise tail (logprob_parity.results.bands),
    with the figures a verdict names beside them; nothing when the tail was not measured."""
    if floor.get("hf_noise_tail") is None:
        return {}
    from logprob_parity.results.bands import band_stats
    from logprob_parity.results.metrics import concat

    m = concat([s.metrics for s in run.sequences])
    return {
        "n_tokens": run.summary.get("n_tokens"),
        "max_prob_delta": run.summary.get("max_prob_delta"),
        **band_stats(m.abs_delta, m.prob_delta, m.argmax_agree, m.scored, floor["hf_noise_tail"], "tail"),
    }


def _reference(v: list[np.ndarray], h: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, Any]:
    dv = np.concatenate([np.abs(a - r) for a, r in zip(v, ref)])
    dh = np.concatenate([np.abs(a - r) for a, r in zip(h, ref)])
    ok = np.isfinite(dv) & np.isfinite(dh)
    dv, dh = dv[ok], dh[ok]
    decided = dv != dh
    frac_v = float((dv[decided] < dh[decided]).mean()) if decided.any() else None
    mv, mh = float(dv.mean()), float(dh.mean())
    closer = closer_to_reference(mv, mh)  # the verdict's own rule
    return {
        "vllm_vs_ref": {"mean": mv, "max": float(dv.max())},
        "hf_vs_ref": {"mean": mh, "max": float(dh.max())},
        "frac_tokens_vllm_closer": frac_v,
        "frac_tokens_tied": float((~decided).mean()),
        "closer_overall": closer,
    }


def _greedy(tokenizer: Any, hf: list[int], vl: list[int]) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(hf, vl)) if a != b), None)
    out: dict[str, Any] = {
        "n_tokens": len(hf),
        "hf_text": tokenizer.decode(hf),
        "vllm_text": tokenizer.decode(vl),
        "first_difference": first,
    }
    if first is not None:
        out["hf_token"] = tokenizer.decode([hf[first]])
        out["vllm_token"] = tokenizer.decode([vl[first]])
    return out


def _mcq_items(tokenizer: Any, bos: str) -> list[dict[str, Any]]:
    """Each option as one sequence: the question, a space, the option; the continuation is scored
    the way evaluation harnesses do it (sum of the option tokens' logprobs)."""
    items = []
    for qi, line in enumerate(_data_lines("mcq.jsonl")):
        q = json.loads(line)
        ctx = list(tokenize(tokenizer, q["question"], bos).token_ids)
        for oi, opt in enumerate(q["options"]):
            full = list(tokenize(tokenizer, q["question"] + " " + opt, bos).token_ids)
            start = next((i for i, (a, b) in enumerate(zip(ctx, full)) if a != b), min(len(ctx), len(full)))
            items.append({"q": qi, "option": oi, "answer": q["answer"], "ids": full, "start": max(start, 1)})
    return items


def _mcq_picks(items: list[dict[str, Any]], scores: list[Any]) -> list[int]:
    best: dict[int, tuple[float, int]] = {}
    for it, sc in zip(items, scores):
        total = float(np.sum(sc.logprob[it["start"] :]))
        if it["q"] not in best or total > best[it["q"]][0]:
            best[it["q"]] = (total, it["option"])
    return [best[q][1] for q in sorted(best)]


def _mcq_summary(items: list[dict[str, Any]], picks: dict[str, list[int]]) -> dict[str, Any]:
    answers = {it["q"]: it["answer"] for it in items}
    truth = [answers[q] for q in sorted(answers)]
    flips = [i for i, (a, b) in enumerate(zip(picks["hf"], picks["vllm"])) if a != b]
    return {
        "n_questions": len(truth),
        "hf_accuracy": float(np.mean([p == t for p, t in zip(picks["hf"], truth)])) if truth else None,
        "vllm_accuracy": float(np.mean([p == t for p, t in zip(picks["vllm"], truth)])) if truth else None,
        "flips_between_engines": len(flips),
        "flipped_questions": flips,
    }


def _dtype_flips(picks: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    """Per engine: answers that change between each dtype and the most precise one run."""
    order = [d for d in ("float32", "bfloat16", "float16") if d in picks]
    ref = order[0]
    return {
        f"{engine} {d} vs {ref}": sum(a != b for a, b in zip(picks[d][engine], picks[ref][engine]))
        for d in order[1:]
        for engine in ("hf", "vllm")
    }


REPLAY_KNOB = "HF with vLLM's expert choices replayed (routing replay)"


def _replay_row(run: Run, hf: Any, vl: Any, seqs: list[list[int]], base_v: list[np.ndarray], emit: Any) -> dict[str, Any] | None:
    """For an MoE model: HF scored again with vLLM's expert ids forced on every MoE layer, weights
    from HF's own router logits (R3's rule, logprob_parity.engines.routing.Replay), and the gap to vLLM
    that is left: the share of the gap that routing explains. None for a dense model."""
    h_routes = hf.routes(seqs)
    if isinstance(h_routes, str):
        return None
    v_routes = vl.routes(seqs)
    if isinstance(v_routes, str):
        return None
    emit("ablation", run.dtype, "HF again with vLLM's expert choices replayed on every MoE layer (routing replay)")
    g = gap(base_v, hf.replay_score(seqs, v_routes))
    base = run.summary["mean_abs_delta"]
    return {
        "dtype": run.dtype,
        "knob": REPLAY_KNOB,
        "mean_abs_delta": g["mean"],
        "max_abs_delta": g["max"],
        "change": None if g["mean"] is None else g["mean"] - base,
        "run_id": None,
        "note": "HF scored with vLLM's expert ids forced, their weights from HF's router logits (R3, arXiv 2510.11370)",
    }


def _ablation(spec: RunSpec, ctx: Context, base_runs: list[Run], device: str, slow: bool) -> list[dict[str, Any]]:
    emit = ctx.emit
    rows = []
    for run in base_runs:
        base = run.summary["mean_abs_delta"]
        rows.append(
            {
                "dtype": run.dtype,
                "knob": "baseline",
                "mean_abs_delta": base,
                "max_abs_delta": run.summary["max_abs_delta"],
                "change": 0.0,
                "run_id": run.run_id,
                "note": json.dumps(spec.settings.to_dict(), sort_keys=True),
            }
        )
        for name, change, note in ablation_knobs(device, slow):
            if change is None:
                rows.append(
                    {
                        "dtype": run.dtype,
                        "knob": name,
                        "mean_abs_delta": None,
                        "max_abs_delta": None,
                        "change": None,
                        "run_id": None,
                        "note": note,
                    }
                )
                continue
            emit("ablation", run.dtype, name)
            try:
                (r,) = compare(replace(spec, dtypes=(run.dtype,), settings=replace(spec.settings, **change)), ctx)
            except Exception as exc:
                rows.append(
                    {
                        "dtype": run.dtype,
                        "knob": name,
                        "mean_abs_delta": None,
                        "max_abs_delta": None,
                        "change": None,
                        "run_id": None,
                        "note": f"failed: {str(exc).splitlines()[0][:200]}",
                    }
                )
                continue
            m = r.summary["mean_abs_delta"]
            rows.append(
                {
                    "dtype": run.dtype,
                    "knob": name,
                    "mean_abs_delta": m,
                    "max_abs_delta": r.summary["max_abs_delta"],
                    "change": m - base,
                    "run_id": r.run_id,
                    "note": "",
                }
            )
    return rows


def knob_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The ablation in words, one meaning per line: per dtype, the setting that removes the most of
    the gap (only a setting that narrows it is ever named as the remedy), then each setting that
    widens it, with how much. A setting that changes nothing is not listed."""
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        base = next((r["mean_abs_delta"] for r in mine if r["knob"] == "baseline"), None)
        tried = [r for r in mine if r["knob"] != "baseline" and r.get("change") is not None]
        if not base or not tried:
            continue
        cuts = [r for r in tried if r["change"] < 0]
        if cuts:
            best = min(cuts, key=lambda r: r["change"])
            out.append(
                f"{dtype}: {best['knob']} removes the most of the gap, {-best['change'] / base:.1%} "
                f"(mean |Δ logp| {base:.2e} → {best['mean_abs_delta']:.2e})"
            )
        else:
            out.append(f"{dtype}: no single setting tried here narrows the gap")
        for r in sorted((r for r in tried if r["change"] > 0), key=lambda r: -r["change"]):
            out.append(
                f"{dtype}: {r['knob']} widens it {r['mean_abs_delta'] / base:.3g}x (mean |Δ logp| {base:.2e} → "
                f"{r['mean_abs_delta']:.2e})"
            )
    return out


def noise_source(key: str, variation: dict[str, Any] | None = None) -> str:
    """A noise measurement's name in words (the keys are the stored JSON's)."""
    words = {
        "hf_batched_right_padding": f"HF against itself: batched with {FILLER_PROMPTS} other prompts, padded on the right",
        "hf_batched_left_padding": f"HF against itself: batched with {FILLER_PROMPTS} other prompts, padded on the left",
        "vllm_alone_vs_batched": "vLLM against itself: alone, then batched with other prompts",
        "vllm_repeat": "vLLM against itself: the same request again",
        "hf_chunked": f"HF against itself: up to {TRAINER_CHUNK} tokens a forward through its KV cache, as trainers score in chunks",
        "hf_incremental": (
            "HF against itself: one token a forward through its KV cache, as a per-prefix script or a decode "
            f"loop scores (the last {INCREMENTAL_TOKENS} tokens of a text longer than {INCREMENTAL_WHOLE})"
        ),
    }
    if key in VARIATIONS or key == "envelope":
        return f"HF against itself, {variation_when(key, variation or {})}"
    if key.startswith("hf_attn_"):
        return f"HF against itself: the {key[len('hf_attn_') :]} attention kernel instead"
    return words.get(key, key.replace("_", " "))


GAP_SOURCE = "vLLM against HF: the gap being judged"
MEAN, MAX = "mean |Δ logp|", "largest |Δ logp|"
TAIL = "99.5th percentile |Δ logp|"  # the noise's tail, where a token leaves it (logprob_parity.analysis.floors)


def diagnostics_tables(result: DiagnosticsResult) -> dict[str, list[dict[str, Any]]]:
    """The result as flat tables (rows of dicts) in words, for the CLI, the dashboard and the report.
    Each column holds one kind of value: gaps in `mean`/`largest` columns, shares in [0, 1] in
    columns named 'share ...', ratios in their own table ('ratios')."""
    noise, ratios, ref, down, layers = [], [], [], [], []
    for d, out in result.dtypes.items():
        layers.extend(layer_rows(d, out.layers))
        if out.noise is not None:
            noise.append({"dtype": d, "what": GAP_SOURCE, MEAN: out.gap["mean"], MAX: out.gap["max"]})
            noise.extend(
                {
                    "dtype": d,
                    "what": noise_source(k, v),
                    MEAN: v["mean"],
                    TAIL: v.get("tail"),
                    MAX: v["max"],
                    "in the floor": k in VARIATIONS,
                }
                for k, v in out.noise.items()
            )
            ratios.append(
                {"dtype": d, "gap ÷ HF's own noise": out.ratio_to_hf_noise, "gap ÷ vLLM's own noise": out.ratio_to_vllm_noise}
            )
        if out.reference is not None:
            r = out.reference
            ref.append(
                {
                    "dtype": d,
                    "mean |vLLM − float64|": r["vllm_vs_ref"]["mean"],
                    "mean |HF − float64|": r["hf_vs_ref"]["mean"],
                    "largest |vLLM − float64|": r["vllm_vs_ref"]["max"],
                    "largest |HF − float64|": r["hf_vs_ref"]["max"],
                    "share of tokens where vLLM is closer": r["frac_tokens_vllm_closer"],
                    # the verdict's rule, also for a diagnosis stored before it
                    "closer overall": closer_to_reference(r["vllm_vs_ref"]["mean"], r["hf_vs_ref"]["mean"]),
                }
            )
        if out.greedy is not None and out.mcq is not None:
            g, m = out.greedy, out.mcq
            first = g["first_difference"]
            down.append(
                {
                    "dtype": d,
                    "greedy text": (
                        f"identical for all {g['n_tokens']} generated tokens"
                        if first is None
                        else f"differs from generated token {first + 1}: HF {g.get('hf_token')!r}, vLLM {g.get('vllm_token')!r}"
                    ),
                    "answers that differ (HF vs vLLM)": f"{m['flips_between_engines']} of {m['n_questions']}",
                    "share correct, HF": m["hf_accuracy"],
                    "share correct, vLLM": m["vllm_accuracy"],
                }
            )
    return {
        "noise": noise,
        "ratios": ratios,
        "reference": ref,
        "downstream": down,
        "layers": layers,
        "ablation": list(result.ablation),
    }


def layer_rows(dtype: str, prof: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The layer part as a table: one row per (layer, block), medians over the text's tokens."""
    from logprob_parity.analysis.layers import block_words

    if not prof or "per_layer" not in prof:
        return []
    return [
        {
            "dtype": dtype,
            "layer": r["layer"],
            "block": block_words(r["block"], r["layer"], prof["moe_layers"]),
            "median relative error, vLLM vs HF": r["vllm_vs_hf_median"],
            "HF's own floor": r["floor"],
            "tokens beyond the floor": f"{r['tokens_beyond']} of {prof['n_tokens']}",
            "median relative error, vLLM vs float64": r["vllm_vs_ref_median"],
            "median relative error, HF vs float64": r["hf_vs_ref_median"],
            "parts": r["parts"],
        }
        for r in prof["per_layer"]
    ]


ABLATION_WORDS = {
    "knob": "setting changed",
    "mean_abs_delta": MEAN,
    "max_abs_delta": MAX,
    "change": "change in the mean gap",
    "removed": "share of the gap removed",
    "note": "note",
}


def ablation_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Knob-attribution rows in words, with the share of the baseline gap each setting removes."""
    base = {r["dtype"]: r["mean_abs_delta"] for r in rows if r["knob"] == "baseline"}
    out = []
    for r in rows:
        b = base.get(r["dtype"])
        removed = (0.0 - r["change"] / b) if (r.get("change") is not None and b and r["knob"] != "baseline") else None
        row = {
            "dtype": r["dtype"],
            **{ABLATION_WORDS[k]: r.get(k) for k in ("knob", "mean_abs_delta", "max_abs_delta", "change")},
        }
        row[ABLATION_WORDS["removed"]] = removed
        row["note"] = "the settings as run" if r["knob"] == "baseline" else r.get("note", "")
        out.append(row)
    return out
