"""Beyond "here is the difference": is it more than the noise, which knob moves it, which side is
closer to a float64 reference, and does it change a downstream answer?

Everything runs on the same token ids as the comparison, on the warm engines where possible.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from typing import Any

import numpy as np

from core import engines
from core.compare import check_lengths, compare, load_kwargs, model_max_len
from core.env import device_name, resolve_device, versions
from core.models import resolve_model
from core.run import Run
from core.spec import RunSpec, content_hash
from core.store import Store
from core.tokens import load_tokenizer, tokenize
from core.verdict import verdict

PARTS = ("noise", "reference", "downstream", "ablation")
FILLER_PROMPTS = 6  # other prompts batched beside the user's, for batch-composition noise
REFERENCE_DTYPE = "float64"

EventFn = Callable[[str, "str | None", str], None]


def _data_lines(name: str) -> list[str]:
    return resources.files("core").joinpath("data").joinpath(name).read_text(encoding="utf-8").splitlines()


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
    """|a - b| over positions both sides scored: mean, max, and how many."""
    d = np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)) for x, y in zip(a, b)])
    d = d[np.isfinite(d)]
    if d.size == 0:
        return {"mean": None, "max": None, "n": 0}
    return {"mean": float(d.mean()), "max": float(d.max()), "n": int(d.size)}


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
        ("vLLM chunked prefill, max_num_batched_tokens=32", {"enable_chunked_prefill": True, "max_num_batched_tokens": 32, "max_num_seqs": 8}, ""),
        ("HF attn_implementation=eager", {"attn_implementation": "eager"}, ""),
    ]
    if device == "cuda" or slow:
        knobs.append(("vLLM torch.compile + graphs (enforce_eager off)", {"enforce_eager": False}, ""))
    else:
        knobs.append(("vLLM torch.compile + graphs (enforce_eager off)", None, "skipped: compiling on CPU takes minutes (--slow-knobs runs it)"))
    if device == "cuda":
        for backend in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"):
            knobs.append((f"vLLM attention_backend={backend}", {"attention_backend": backend}, ""))
        knobs.append(("HF TF32 matmuls", None, "skipped: not an engine setting yet (torch.backends.cuda.matmul.allow_tf32)"))
        knobs.append(("vLLM batch-invariant mode", None, "skipped: needs VLLM_BATCH_INVARIANT=1 in the engine's environment (not wired yet)"))
    else:
        knobs.append(("vLLM attention backends", None, "skipped: vLLM's CPU build has one attention backend (CPU_ATTN)"))
        knobs.append(("HF TF32 matmuls", None, "skipped: TF32 exists on NVIDIA GPUs only"))
        knobs.append(("vLLM batch-invariant mode", None, "skipped: vLLM's batch-invariant kernels need CUDA"))
    knobs.append(("vLLM fp32 LM head", None, f"skipped: no such option in vLLM {versions()['vllm']}"))
    return knobs


def diagnose(
    spec: RunSpec,
    store: Store | None = None,
    parts: tuple[str, ...] = ("noise", "reference", "downstream"),
    gen_tokens: int = 16,
    slow_knobs: bool = False,
    on_event: EventFn | None = None,
) -> dict[str, Any]:
    """Run the chosen diagnostics for every dtype of the spec; the result is plain JSON data."""
    emit = on_event or (lambda *a: None)
    unknown = set(parts) - set(PARTS)
    if unknown:
        from core.errors import UserError

        raise UserError(f"unknown diagnostic(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    store = store or Store()
    base_runs = compare(spec, store=store, on_event=on_event)
    device = resolve_device(spec.device)
    model = resolve_model(spec.model, spec.revision, spec.settings.trust_remote_code)
    tokenizer = load_tokenizer(model.path, spec.settings.trust_remote_code)
    toks = check_lengths([tokenize(tokenizer, t, spec.bos) for t in spec.texts], model, spec.top_k, spec.truncate)
    seqs = [list(t.token_ids) for t in toks]
    filler = [list(tokenize(tokenizer, t, spec.bos).token_ids) for t in _data_lines("sentences.txt")[:FILLER_PROMPTS]]
    mcq = _mcq_items(tokenizer, spec.bos) if "downstream" in parts else []
    # the comparison's own max_model_len, so the warm engines of the comparison serve the diagnostics
    longest = max(len(s) for s in seqs)
    mml = model_max_len(longest, model.max_positions)
    ctx = seqs + [f for f in filler if len(f) < mml]
    mcq = [m for m in mcq if len(m["ids"]) < mml]
    gen = min(gen_tokens, mml - len(seqs[0]) - 1)

    result: dict[str, Any] = {
        "model": model.name,
        "device": device_name(device),
        "versions": {k: v for k, v in versions().items() if k != "vllm_dist"},
        "texts": list(spec.texts),
        "parts": list(parts),
        "run_ids": {r.dtype: r.run_id for r in base_runs},
        "dtypes": {},
        "ablation": [],
    }
    picks: dict[str, dict[str, list[int]]] = {}
    for run in base_runs:
        d = run.dtype
        out: dict[str, Any] = {"run_id": run.run_id, "gap": {"mean": run.summary["mean_abs_delta"], "max": run.summary["max_abs_delta"]}}
        load = load_kwargs(model, d, device, spec.settings, mml)
        emit("load", d, "engines for diagnostics")
        hf, vl = engines.worker_for("hf", load), engines.worker_for("vllm", load)
        base_hf = [s.hf.logprob for s in run.sequences]
        base_v = [s.vllm.logprob for s in run.sequences]
        n = len(seqs)
        if "noise" in parts:
            emit("noise", d, "HF batched/padded, other attention; vLLM alone/batched/repeated")
            with engines.device_lock:
                noise = {
                    "hf_batched_right_padding": gap(base_hf, _lp(hf.score(ctx, 1, None, len(ctx), "right")[:n])),
                    "hf_batched_left_padding": gap(base_hf, _lp(hf.score(ctx, 1, None, len(ctx), "left")[:n])),
                    "vllm_alone_vs_batched": gap(_lp(vl.score(seqs, 1, None, 1)), _lp(vl.score(ctx, 1)[:n])),
                    "vllm_repeat": gap(base_v, _lp(vl.score(seqs, 1))),
                }
            other = "eager" if (spec.settings.attn_implementation or "sdpa") != "eager" else "sdpa"
            hf_other = engines.worker_for("hf", load_kwargs(model, d, device, replace(spec.settings, attn_implementation=other), mml))
            with engines.device_lock:
                noise[f"hf_attn_{other}"] = gap(base_hf, _lp(hf_other.score(seqs, 1)))
            hf_floor = max((v["mean"] or 0.0) for k, v in noise.items() if k.startswith("hf_"))
            v_floor = max((v["mean"] or 0.0) for k, v in noise.items() if k.startswith("vllm_"))
            out["noise"] = noise
            out["floor"] = {"hf": hf_floor, "vllm": v_floor}
            out["ratio_to_hf_noise"] = _ratio(out["gap"]["mean"], hf_floor)
            out["ratio_to_vllm_noise"] = _ratio(out["gap"]["mean"], v_floor)
        if "reference" in parts:
            emit("reference", d, f"HF in {REFERENCE_DTYPE} on the CPU")
            ref_w = engines.worker_for("hf", load_kwargs(model, REFERENCE_DTYPE, "cpu", spec.settings, mml))
            with engines.device_lock:
                ref = _lp(ref_w.score(seqs, 1))
            out["reference"] = _reference(base_v, base_hf, ref)
        if "downstream" in parts:
            emit("downstream", d, f"greedy {gen} tokens; {len(mcq)} multiple-choice options")
            with engines.device_lock:
                g_hf = hf.generate([seqs[0]], gen)[0] if gen > 0 else []
                g_v = vl.generate([seqs[0]], gen)[0] if gen > 0 else []
                mc_hf = hf.score([m["ids"] for m in mcq], 1) if mcq else []
                mc_v = vl.score([m["ids"] for m in mcq], 1) if mcq else []
            out["greedy"] = _greedy(tokenizer, g_hf, g_v)
            picks[d] = {"hf": _mcq_picks(mcq, mc_hf), "vllm": _mcq_picks(mcq, mc_v)}
            out["mcq"] = _mcq_summary(mcq, picks[d])
        out["verdict"] = verdict(run.summary, d, out.get("ratio_to_hf_noise")).to_dict()
        result["dtypes"][d] = out
    if picks:
        result["mcq_dtype_flips"] = _dtype_flips(picks)
    if "ablation" in parts:
        result["ablation"] = _ablation(spec, store, base_runs, device, slow_knobs, emit)
    result["diagnostics_id"] = content_hash({k: result[k] for k in ("model", "device", "versions", "texts", "parts", "run_ids")} | {"gen": gen_tokens})
    result = json.loads(json.dumps(result, allow_nan=False))  # exactly what the store gives back
    save_diagnostics(store, result)
    return result


def _reference(v: list[np.ndarray], h: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, Any]:
    dv = np.concatenate([np.abs(a - r) for a, r in zip(v, ref)])
    dh = np.concatenate([np.abs(a - r) for a, r in zip(h, ref)])
    ok = np.isfinite(dv) & np.isfinite(dh)
    dv, dh = dv[ok], dh[ok]
    decided = dv != dh
    frac_v = float((dv[decided] < dh[decided]).mean()) if decided.any() else None
    mv, mh = float(dv.mean()), float(dh.mean())
    closer = "tie" if mv == mh else ("vLLM" if mv < mh else "HF")
    return {
        "vllm_vs_ref": {"mean": mv, "max": float(dv.max())},
        "hf_vs_ref": {"mean": mh, "max": float(dh.max())},
        "frac_tokens_vllm_closer": frac_v,
        "frac_tokens_tied": float((~decided).mean()),
        "closer_overall": closer,
    }


def _greedy(tokenizer: Any, hf: list[int], vl: list[int]) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(hf, vl)) if a != b), None)
    out: dict[str, Any] = {"n_tokens": len(hf), "hf_text": tokenizer.decode(hf), "vllm_text": tokenizer.decode(vl), "first_difference": first}
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


def _ablation(spec: RunSpec, store: Store, base_runs: list[Run], device: str, slow: bool, emit: EventFn) -> list[dict[str, Any]]:
    rows = []
    for run in base_runs:
        base = run.summary["mean_abs_delta"]
        rows.append({"dtype": run.dtype, "knob": "baseline", "mean_abs_delta": base, "max_abs_delta": run.summary["max_abs_delta"],
                     "change": 0.0, "run_id": run.run_id, "note": json.dumps(spec.settings.to_dict(), sort_keys=True)})
        for name, change, note in ablation_knobs(device, slow):
            if change is None:
                rows.append({"dtype": run.dtype, "knob": name, "mean_abs_delta": None, "max_abs_delta": None, "change": None, "run_id": None, "note": note})
                continue
            emit("ablation", run.dtype, name)
            try:
                (r,) = compare(replace(spec, dtypes=(run.dtype,), settings=replace(spec.settings, **change)), store=store)
            except Exception as exc:  # noqa: BLE001 - a knob this engine refuses is a finding, not a crash
                rows.append({"dtype": run.dtype, "knob": name, "mean_abs_delta": None, "max_abs_delta": None, "change": None,
                             "run_id": None, "note": f"failed: {str(exc).splitlines()[0][:200]}"})
                continue
            m = r.summary["mean_abs_delta"]
            rows.append({"dtype": run.dtype, "knob": name, "mean_abs_delta": m, "max_abs_delta": r.summary["max_abs_delta"],
                         "change": m - base, "run_id": r.run_id, "note": ""})
    return rows


def biggest_knob(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    tried = [r for r in rows if r["knob"] != "baseline" and r["change"] is not None]
    return max(tried, key=lambda r: abs(r["change"])) if tried else None


def save_diagnostics(store: Store, result: dict[str, Any]) -> None:
    folder = store.root / "diagnostics"
    folder.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, allow_nan=False)
    os.replace(tmp, folder / f"{result['diagnostics_id']}.json")


def load_diagnostics(store: Store, diag_id: str) -> dict[str, Any]:
    from core.errors import UserError

    if not diag_id or not all(c in "0123456789abcdef" for c in diag_id):
        raise UserError(f"{diag_id!r} is not a diagnostics id")
    path = store.root / "diagnostics" / f"{diag_id}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no stored diagnostics with id {diag_id!r}") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"stored diagnostics {diag_id} are unreadable: {exc}") from exc


def diagnostics_for_run(store: Store, run_id: str) -> dict[str, Any] | None:
    """The newest diagnostics that include this run, if any (JSON only, never pickle)."""
    folder = store.root / "diagnostics"
    if not folder.is_dir():
        return None
    found = []
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if run_id in data.get("run_ids", {}).values():
            found.append((path.stat().st_mtime, data))
    return max(found, key=lambda x: x[0])[1] if found else None


def _f(v: Any) -> str:
    return "-" if v is None else (f"{v:.3e}" if isinstance(v, float) else str(v))


def diagnostics_tables(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The result as flat tables (rows of dicts) for the CLI, the dashboard and the report."""
    noise, ref, down = [], [], []
    for d, out in result["dtypes"].items():
        if "noise" in out:
            noise.append({"dtype": d, "source": "vLLM vs HF (the gap)", "mean_abs": out["gap"]["mean"], "max_abs": out["gap"]["max"]})
            noise.extend({"dtype": d, "source": k, "mean_abs": v["mean"], "max_abs": v["max"]} for k, v in out["noise"].items())
            noise.append({"dtype": d, "source": "gap / HF's own noise", "mean_abs": out["ratio_to_hf_noise"], "max_abs": None})
        if "reference" in out:
            r = out["reference"]
            ref.append({"dtype": d, "mean |vLLM - ref|": r["vllm_vs_ref"]["mean"], "mean |HF - ref|": r["hf_vs_ref"]["mean"],
                        "max |vLLM - ref|": r["vllm_vs_ref"]["max"], "max |HF - ref|": r["hf_vs_ref"]["max"],
                        "tokens where vLLM is closer": r["frac_tokens_vllm_closer"], "closer overall": r["closer_overall"]})
        if "greedy" in out:
            g, m = out["greedy"], out["mcq"]
            down.append({"dtype": d, "greedy first difference": g["first_difference"],
                         "HF token there": g.get("hf_token"), "vLLM token there": g.get("vllm_token"),
                         "MCQ flips HF vs vLLM": f"{m['flips_between_engines']}/{m['n_questions']}",
                         "MCQ accuracy HF": m["hf_accuracy"], "MCQ accuracy vLLM": m["vllm_accuracy"]})
    return {"noise": noise, "reference": ref, "downstream": down, "ablation": result.get("ablation", [])}


def diagnostics_text(result: dict[str, Any]) -> str:
    import pandas as pd

    lines = [f"diagnostics {result['diagnostics_id']}  model {result['model']}  device {result['device']}"]
    for d, out in result["dtypes"].items():
        v = out["verdict"]
        lines += ["", f"[{v['level'].upper()}] {v['headline']}"] + [f"  - {r}" for r in v["reasons"]]
    for name, rows in diagnostics_tables(result).items():
        if rows:
            lines += ["", f"== {name} =="]
            lines.append(pd.DataFrame(rows).drop(columns=["note", "run_id"], errors="ignore").to_string(index=False, float_format=_f))
    knob = biggest_knob(result.get("ablation", []))
    if knob:
        lines += ["", f"The knob that moves the gap most: {knob['knob']} ({knob['dtype']}: mean |Δ| change {knob['change']:+.3e})"]
    if result.get("mcq_dtype_flips"):
        lines += ["", "MCQ answer flips between dtypes: " + ", ".join(f"{k}: {v}" for k, v in result["mcq_dtype_flips"].items())]
    return "\n".join(lines)
