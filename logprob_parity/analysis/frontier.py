"""The accuracy–speed frontier: which engine configuration is both fast and accurate?

Every configuration (a dtype plus vLLM settings: attention backend, CUDA graphs, TF32,
batch-invariant mode, FP8 weights, FP8 KV cache) scores the same token ids. Each is measured
against one reference, HF in float64 on the request's device:
- `ref_gap`: vLLM in that configuration against the reference: mean and max |Δ logp| of the
  tokens, and the mean exact full-vocabulary KL(reference ‖ vLLM) (logprob_parity.engines.fullvocab);
- `hf_ref_gap`: the same for HF in that dtype (HF's own rounding, the yardstick);
- `tokens_per_s`: vLLM prefill scoring (prompt logprobs of every token) and greedy generation, on a
  load of realistic size (64 x 512 tokens of the same model on a GPU; `speed_load`), warm, timed
  `repeats` times: the median and the spread (slowest, fastest). The user's few texts measure
  accuracy; timed alone they would measure per-call overhead;
- `memory`: the vLLM engine's weights and its KV cache's bytes per token, so FP8's halving shows;
- `start_s`: the vLLM engine's imports and load in its own process, when this request started
  it. Configurations run in groups of as many as the pool has room for (memory and its engine
  cap); a group's engines start side by side, sharing the CPU, and nothing is timed until all of
  them have loaded.
A configuration the platform cannot run is listed with the reason, not dropped. The recommendation
is the fastest configuration (prefill tokens/s) whose mean gap is within a tolerance (by default twice
HF's own float32 gap to the same reference, measured in the same request), counting as faster only
a difference larger than the spread of the repeats: among those equally fast, the most accurate.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from logprob_parity.analysis.request import Context, Prepared, model_max_len, prepare
from logprob_parity.engines import build, fullvocab
from logprob_parity.engines.host import start_words
from logprob_parity.engines.records import LoadRequest
from logprob_parity.env import device_name, versions
from logprob_parity.errors import EngineError, UserError
from logprob_parity.inputs.prompts import filler_ids
from logprob_parity.inputs.spec import RunSpec, content_hash
from logprob_parity.results.frontier import FrontierResult

REFERENCE_DTYPE = "float64"


def progress_steps(n_configs: int, repeats: int) -> int:
    """The progress events a frontier of n configurations emits, about: its start and store, and for
    each configuration its start, its speed's 2 x repeats timed runs and its accuracy (a page's
    "step N of about M" moves with each of them)."""
    return 3 + n_configs * (4 + 2 * repeats)


GEN_TOKENS = 32  # greedy tokens per prompt for the generation throughput
# The speed load, sequences x tokens: what a configuration's speed is measured on (its accuracy is
# measured on the user's texts), and how many times each speed is timed.
SPEED_LOAD = {"cuda": (64, 512), "cpu": (4, 128)}
REPEATS = 3
# The default tolerance: a configuration no more than this many times farther from float64 than HF
# in float32 is "as accurate as HF float32" (the verdict's REFERENCE_SIDE_RATIO, the same rule).
TOLERANCE_FACTOR = 2.0


# Not an engine setting: `checkpoint=PATH` names a pre-quantized checkpoint of the same model (GPTQ,
# AWQ, FP8, compressed-tensors) that the configuration's vLLM engine loads in place of the model;
# it is scored on the model's token ids against the model's own weights in float64.
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Config:
    """One configuration: a dtype and the vLLM settings it changes (names of logprob_parity.inputs.settings)."""

    dtype: str
    changes: tuple[tuple[str, Any], ...] = ()
    skip: str | None = None  # why this platform cannot run it, known before trying
    label: str | None = None  # a name in words for an entry no setting describes (one that is only listed)

    @property
    def name(self) -> str:
        return self.label or self.dtype + "".join(f" {k}={v}" for k, v in self.changes)

    def settings(self, base: Any) -> Any:
        return dataclasses.replace(base, **{k: v for k, v in self.changes if k != CHECKPOINT})

    @property
    def checkpoint(self) -> str | None:
        """A pre-quantized checkpoint of the same model that this configuration's vLLM engine loads."""
        return dict(self.changes).get(CHECKPOINT)


def parse_configs(text: str) -> list[Config]:
    """'float32; bfloat16 kv_cache_dtype=fp8; float32 attention_backend=FLEX_ATTENTION enforce_eager=False'."""
    from logprob_parity.inputs.settings import SETTINGS
    from logprob_parity.inputs.spec import DTYPES

    known = {s.name: s for s in SETTINGS}
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        words = part.split()
        if words[0] not in DTYPES:
            raise UserError(f"configuration {part!r} must start with a dtype ({', '.join(DTYPES)})")
        changes = []
        for w in words[1:]:
            name, sep, raw = w.partition("=")
            if name == CHECKPOINT and sep and raw:
                changes.append((CHECKPOINT, raw))
                continue
            if not sep or name not in known:
                # Words for both front ends: what to type, with the names to type, not a pointer to `--help`.
                raise UserError(
                    f"configuration {part!r}: {w!r} is not setting=value with a known setting. Type a dtype, then "
                    f"setting=value pairs, e.g. 'float32 attention_backend=FLEX_ATTENTION'. The known settings: "
                    f"{', '.join(sorted(known))}, and checkpoint=PATH."
                )
            s = known[name]
            value: Any = raw
            if s.kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise UserError(f"configuration {part!r}: {name} takes true or false")
                value = raw.lower() in ("true", "1")
            elif s.kind in (int, float):
                try:
                    value = s.kind(raw)
                except ValueError:
                    raise UserError(f"configuration {part!r}: {name} takes a number") from None
            changes.append((name, s.check(value)))
        out.append(Config(words[0], tuple(changes)))
    if not out:
        raise UserError("no configuration given; e.g. --configs 'float32; bfloat16'")
    return out


def with_build_skip(c: Config) -> Config:
    """The configuration, listed as skipped with the reason when this vLLM build cannot run its settings
    (asked of the build: logprob_parity.engines.build), so it is neither offered as runnable nor started."""
    if c.skip:
        return c
    why = next((w for (name, value), w in build.unsupported().items() if (name, value) in c.changes), None)
    return dataclasses.replace(c, skip=why) if why else c


def default_grid(device: str) -> list[Config]:
    """What the platform can run, with what it cannot listed and why (the platform's limits here, the
    vLLM build's from the build itself)."""
    return [with_build_skip(c) for c in _grid(device)]


def _grid(device: str) -> list[Config]:
    gpu = device != "cpu"
    grid = [Config(d) for d in ("float16", "bfloat16", "float32")]
    grid += [
        Config("bfloat16", (("kv_cache_dtype", "fp8"),)),
        Config("bfloat16", (("quantization", "fp8"),)),
        Config("float16", (("quantization", "fp8"),)),
    ]
    if gpu:
        grid += [
            Config("bfloat16", (("enforce_eager", False),)),
            Config("float32", (("enforce_eager", False),)),
            Config("float32", (("tf32", True),)),
            Config("bfloat16", (("batch_invariant", True),)),
            Config("float32", (("batch_invariant", True),)),
        ]
        grid += [
            Config(d, (("attention_backend", b),))
            for d in ("bfloat16", "float32")
            for b in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
        ]
        grid.append(PREQUANTIZED)
    else:
        why = "NVIDIA GPUs only"
        grid += [
            Config("float32", (("tf32", True),), skip=f"TF32: {why}"),
            Config("bfloat16", (("batch_invariant", True),), skip=f"vLLM's batch-invariant kernels: {why}"),
            Config(
                "bfloat16", (("enforce_eager", False),), skip="CUDA graphs: GPUs only (on a CPU vLLM would compile for minutes)"
            ),
            Config(
                "bfloat16",
                (("attention_backend", "FLEX_ATTENTION"),),
                skip="vLLM's CPU build has one attention backend (CPU_ATTN)",
            ),
            PREQUANTIZED,
        ]
    return grid


# Listed with how to add one: a checkpoint quantized ahead of time is a folder the grid cannot guess.
PREQUANTIZED = Config(
    "bfloat16",
    label="a pre-quantized checkpoint (GPTQ, AWQ, FP8, compressed-tensors)",
    skip=(
        "a checkpoint is its own folder, so name it: add a configuration 'bfloat16 checkpoint=PATH' and its vLLM engine "
        "loads that checkpoint, scored on this model's token ids against this model in float64"
    ),
)


def pareto(configs: list[dict[str, Any]]) -> list[str]:
    """Names of the configurations no other beats on both error (mean gap, lower) and speed
    (prefill tokens/s, higher)."""
    ok = [c for c in configs if not c["skipped"]]
    front = []
    for c in ok:
        e, s = c["ref_gap"]["mean"], c["tokens_per_s"]["prefill"]
        if not any(
            (o["ref_gap"]["mean"] <= e and o["tokens_per_s"]["prefill"] >= s)
            and (o["ref_gap"]["mean"] < e or o["tokens_per_s"]["prefill"] > s)
            for o in ok
        ):
            front.append(c["name"])
    return front


def _spread(c: dict[str, Any]) -> tuple[float, float]:
    """(slowest, fastest) prefill tokens/s of a configuration's repeats (its median alone for
    frontiers stored before repeats were kept)."""
    tps = c["tokens_per_s"]
    lo, hi = tps.get("prefill_spread") or (tps["prefill"], tps["prefill"])
    return float(lo), float(hi)


def recommend(configs: list[dict[str, Any]], tolerance: float | None, source: str) -> dict[str, Any]:
    """The fastest configuration within the tolerance, where faster means faster than the spread of
    the repeats: configurations whose spreads overlap the fastest one's are equally fast, and of
    those the most accurate is recommended."""
    ok = [c for c in configs if not c["skipped"]]
    if not ok:
        return {"name": None, "why": "no configuration ran on this platform"}
    if tolerance is None:
        return {"name": None, "why": "no tolerance: HF in float32 did not run, and none was given"}
    within = [c for c in ok if c["ref_gap"]["mean"] <= tolerance]
    if not within:
        best = min(ok, key=lambda c: c["ref_gap"]["mean"])
        return {
            "name": None,
            "why": f"no configuration is within {tolerance:.2e} ({source}); the most accurate is "
            f"{best['name']} at {best['ref_gap']['mean']:.2e}",
        }
    fast = max(within, key=lambda c: c["tokens_per_s"]["prefill"])
    tied = [c for c in within if _spread(c)[1] >= _spread(fast)[0]]
    pick = min(tied, key=lambda c: c["ref_gap"]["mean"])
    lo, hi = _spread(pick)
    speed = (
        f"{pick['tokens_per_s']['prefill']:,.0f} prefill tokens/s, {lo:,.0f}-{hi:,.0f} over "
        f"{pick['tokens_per_s'].get('repeats', 1)} repeats"
    )
    if len(tied) > 1:
        others = ", ".join(c["name"] for c in tied if c is not pick)
        lead = (
            f"as fast as any configuration within the tolerance ({speed}): {others} "
            f"{'is' if len(tied) == 2 else 'are'} no faster beyond the spread of the repeats, and of these it is the "
            "most accurate"
        )
    elif len(within) == 1:
        lead = f"the only configuration within the tolerance ({speed})"
    else:
        lead = f"the fastest configuration ({speed}), faster than every other within the tolerance by more than the spread"
    counted = f"{len(within)} of {len(ok)} configurations {'is' if len(within) == 1 else 'are'} within it"
    return {
        "name": pick["name"],
        "why": (
            f"{lead}; its mean gap to the float64 reference, {pick['ref_gap']['mean']:.2e}, is within {tolerance:.2e} ({source}); "
            f"{counted}"
        ),
    }


def frontier(
    spec: RunSpec,
    configs: list[Config] | None = None,
    ctx: Context | None = None,
    tolerance: float | None = None,
    speed_load: tuple[int, int] | None = None,
    repeats: int = REPEATS,
) -> FrontierResult:
    """Measure each configuration on the same token ids against HF in float64, and its speed on
    `speed_load` (sequences, tokens) `repeats` times (at least REPEATS: one timing has no spread, and a
    speed read from it once put float32 31x behind bfloat16 on this CPU); store and return."""
    if repeats < REPEATS:
        raise UserError(f"speed needs at least {REPEATS} timed repeats for its spread to mean something (got {repeats})")
    ctx = ctx or Context.of()
    p = prepare(dataclasses.replace(spec, dtypes=("float32",)), ctx)
    quant = p.model.config.get("quantization_config") or {}
    if quant:
        raise UserError(
            f"{p.model.name} is a pre-quantized checkpoint ({quant.get('quant_method', 'quantized')}): the frontier "
            "measures each configuration against the model's unquantized weights in float64, which this folder "
            "does not hold; give the unquantized model as the model and this folder as a configuration, "
            f"'bfloat16 checkpoint={p.model.path}'"
        )
    configs = [with_build_skip(c) for c in (configs or default_grid(p.device))]
    checkpoints = {c.checkpoint: _checkpoint(p, c.checkpoint) for c in configs if c.checkpoint and not c.skip}
    configs = [
        _checkpoint_skip(
            dataclasses.replace(c, changes=tuple((k, checkpoints[x].path if k == CHECKPOINT else x) for k, x in c.changes)),
            checkpoints[c.checkpoint],
        )
        if c.checkpoint and not c.skip
        else c
        for c in configs
    ]
    ctx.emit("tokenize", None, f"{len(spec.texts)} text(s)")
    seqs = p.seqs
    n_tokens = sum(len(s) - 1 for s in seqs)
    too_big = fullvocab.fits(n_tokens, p.model.vocab_size)
    if too_big:
        raise UserError(f"the frontier needs the exact KL of every position: {too_big}; use shorter texts")
    n_load, load_len = speed_load or SPEED_LOAD["cuda" if p.device.startswith("cuda") else "cpu"]
    if p.model.max_positions:  # a short-context model: the load and its generated tokens must fit
        load_len = max(8, min(load_len, p.model.max_positions - GEN_TOKENS - 1))
    load = filler_ids(p.tokenizer, n_load, load_len)
    # one context length for the user's texts and the speed load (plus what generation adds)
    mml = max(p.max_model_len, model_max_len(load_len + GEN_TOKENS, p.model.max_positions))
    ref_req = LoadRequest("hf", p.model.path, REFERENCE_DTYPE, p.device, p.spec.settings, mml)
    speed = {"load": load, "words": f"{n_load} x {load_len} tokens", "repeats": max(1, repeats)}
    hf_gap: dict[str, dict[str, Any]] = {}
    rows: dict[int, dict[str, Any]] = {
        k: _measure(p, c, None, ref_req, hf_gap, seqs, n_tokens, None, k, len(configs), speed)
        for k, c in enumerate(configs)
        if c.skip
    }
    for group in _groups(p, [(k, c) for k, c in enumerate(configs) if not c.skip], ref_req):
        engines = _engines(p, [c for _, c in group], ref_req)
        if len(group) > 1:
            ctx.emit(
                "load",
                None,
                f"starting {len(engines)} engines side by side for configurations "
                f"{', '.join(str(k + 1) for k, _ in group)} of {len(configs)} ({start_words('vllm', p.device)} alone; "
                "side by side they share the machine)",
            )
        # a configuration whose engines do not fit together under the memory cap (or on the card) runs them in turn
        in_turn = len(group) == 1 and _capped(p, engines) and not ctx.pool.fits_together(engines)
        if in_turn:
            ctx.emit(
                "plan",
                group[0][1].dtype,
                f"configuration {group[0][0] + 1}: its engines do not fit together, so they run in turn",
            )
        with ctx.pool.lease_for(engines, in_turn, on_wait=ctx.waiter(None if len(group) > 1 else group[0][1].dtype)) as lease:
            started = {k: _start(lease, _requests(p, c, mml)[0]) for k, c in group}
            for k, c in group:  # nothing is timed until every engine of the group has loaded
                rows[k] = _measure(p, c, lease, ref_req, hf_gap, seqs, n_tokens, started[k], k, len(configs), speed)
    rows = [rows[k] for k in range(len(configs))]
    source = (
        f"{TOLERANCE_FACTOR:g}x HF's own float32 gap to the float64 reference, measured in this request: "
        "within it a configuration is as accurate as HF in float32"
    )
    if tolerance is None:
        f32 = hf_gap.get("float32")
        tolerance = None if f32 is None else TOLERANCE_FACTOR * f32["mean"]
    else:
        source = "given"
    for r in rows:
        r["pareto"] = False
    for name in pareto(rows):
        next(r for r in rows if r["name"] == name)["pareto"] = True
    rec = recommend(rows, tolerance, source)
    v = {k: x for k, x in versions().items() if k != "vllm_dist"}
    identity = {
        "kind": "frontier",
        "model": p.model.identity,
        "device": device_name(p.device),
        "versions": v,
        "texts": list(spec.texts),
        "configs": [c.name for c in configs],
        "tolerance": tolerance,
        "settings": p.spec.settings.run_id_part(),
        "checkpoints": {k: m.identity for k, m in checkpoints.items()},
        "speed": {"load": speed["words"], "repeats": speed["repeats"]},
    }
    now = dt.datetime.now(dt.timezone.utc)
    result = FrontierResult(
        frontier_id=content_hash(identity),
        model=p.model.name,
        device=device_name(p.device),
        versions=v,
        texts=tuple(spec.texts),
        n_tokens=n_tokens,
        tolerance={"value": tolerance, "source": source},
        configs=tuple(rows),
        recommendation=rec,
        created=now.isoformat(timespec="seconds"),
        created_ts=now.timestamp(),
        speed={"load": speed["words"], "repeats": speed["repeats"], "gen_tokens": GEN_TOKENS},
    )
    ctx.store.save_frontier(result)
    ctx.emit("store", None, f"frontier {result.frontier_id} saved")
    return result


def _gap(ref: list[Any], other: list[Any]) -> dict[str, Any]:
    """mean/max |Δ logp| of the tokens and the mean exact KL, from the reference's scores of `other`'s full logprobs."""
    d = np.concatenate([np.abs(r.logprob[1:] - o.logprob[1:]) for r, o in zip(ref, other)])
    kl = np.concatenate([r.kl_full[1:] for r in ref]) if all(r.kl_full is not None for r in ref) else np.array([np.nan])
    return {"mean": float(d.mean()), "max": float(d.max()), "kl_mean": float(kl.mean()) if np.isfinite(kl).all() else None}


def _requests(p: Prepared, cfg: Config, mml: int) -> tuple[LoadRequest, LoadRequest]:
    """A configuration's vLLM engine (on its checkpoint, if it names one) and the HF engine of the
    model in its dtype (and HF settings), for contexts of `mml` tokens (the reference's: the user's
    texts and the speed load)."""
    settings = cfg.settings(p.spec.settings)
    return (
        LoadRequest("vllm", cfg.checkpoint or p.model.path, cfg.dtype, p.device, settings, mml),
        LoadRequest("hf", p.model.path, cfg.dtype, p.device, settings, mml),
    )


def _checkpoint(p: Prepared, path: str) -> Any:
    """A configuration's pre-quantized checkpoint, resolved under the same model-root rules as the
    model; it must be a checkpoint of the same model (the same vocabulary), since it is scored on the
    model's token ids."""
    from logprob_parity.inputs.models import resolve_model

    try:
        m = resolve_model(path, None, p.spec.settings.trust_remote_code, p.ctx.model_roots)
    except UserError as exc:
        raise UserError(f"configuration checkpoint={path}: {exc}") from None
    if m.vocab_size != p.model.vocab_size:
        raise UserError(
            f"checkpoint {path} has a vocabulary of {m.vocab_size} entries and {p.model.name} one of "
            f"{p.model.vocab_size}: it is not a checkpoint of the same model, so it cannot score its token ids"
        )
    return m


def _checkpoint_skip(c: Config, m: Any) -> Config:
    """The checkpoint's configuration, listed as skipped with the reason when this vLLM build cannot run
    its quantization method on this machine (asked of the build: a GPTQ checkpoint on vLLM's CPU build
    for a processor without AVX-512 has no 4-bit kernel), before its engine starts."""
    method = str((m.config.get("quantization_config") or {}).get("quant_method", "")).lower()
    why = build.unsupported().get((build.QUANT_METHOD, method))
    return dataclasses.replace(c, skip=f"vLLM cannot run this {method} checkpoint here: {why}") if why else c


def _engines(p: Prepared, configs: list[Config], ref_req: LoadRequest) -> list[LoadRequest]:
    """Every engine these configurations need, each once, and the float64 reference."""
    return list({r.key(): r for c in configs for r in _requests(p, c, ref_req.max_model_len)}.values()) + [ref_req]


def _capped(p: Prepared, engines: list[LoadRequest]) -> bool:
    """Whether these engines are bound by a memory cap or a card's memory (on a CPU without a cap they
    run side by side, as they always did)."""
    from logprob_parity.engines.memory import cap_of

    return p.device.startswith("cuda") or any(cap_of(r.settings) for r in engines)


def _groups(p: Prepared, todo: list[tuple[int, Config]], ref_req: LoadRequest) -> list[list[tuple[int, Config]]]:
    """Configurations in runs of as many as fit on the device together (memory and the pool's
    engine cap), so that their engines start side by side; a configuration that fits with no
    other is a group of one."""
    groups: list[list[tuple[int, Config]]] = []
    for k, c in todo:
        if groups and p.ctx.pool.fits_together(_engines(p, [x for _, x in groups[-1]] + [c], ref_req)):
            groups[-1].append((k, c))
        else:
            groups.append([(k, c)])
    return groups


def _start(lease: Any, vreq: LoadRequest) -> tuple[float | None, str | None]:
    """(seconds this engine took to import and load in its own process, None when it was already
    running; why it failed, else None). Engines that start side by side share the CPU, so each
    one's time is longer than alone."""
    warm = lease.warm(vreq)
    try:
        host = lease.host(vreq)
    except (UserError, EngineError) as exc:
        lease.discard(vreq)
        return None, f"vLLM could not start it: {str(exc).splitlines()[0][:300]}"
    t = (host.info or {}).get("load_timing") or {}
    return (None if warm or not t else round(float(t.get("import_s", 0)) + float(t.get("init_s", 0)), 2)), None


def _measure(
    p: Prepared,
    cfg: Config,
    lease: Any,
    ref_req: LoadRequest,
    hf_gap: dict[str, dict[str, Any]],
    seqs: list[list[int]],
    n_tokens: int,
    started: tuple[float | None, str | None] | None,
    k: int,
    n: int,
    speed: dict[str, Any],
) -> dict[str, Any]:
    ctx = p.ctx
    ctx.emit("frontier", cfg.dtype, f"configuration {k + 1} of {n}: {cfg.name}")
    row: dict[str, Any] = {
        "name": cfg.name,
        "dtype": cfg.dtype,
        "settings": dict(cfg.changes),
        "ref_gap": None,
        "hf_ref_gap": None,
        "tokens_per_s": None,
        "memory": None,
        "start_s": None,
        "skipped": cfg.skip,
    }
    if cfg.skip or started is None:
        return row
    row["start_s"], row["skipped"] = started
    if row["skipped"]:
        return row
    vreq, hreq = _requests(p, cfg, ref_req.max_model_len)
    settings = vreq.settings
    vllm, hf, ref = lease.host(vreq), lease.host(hreq), lease.host(ref_req)
    vfolder, why = fullvocab.folder_for(n_tokens, p.model.vocab_size)
    hfolder, _ = fullvocab.folder_for(n_tokens, p.model.vocab_size) if vfolder else (None, why)
    if vfolder is None or hfolder is None:
        fullvocab.remove(vfolder)
        fullvocab.remove(hfolder)
        row["skipped"] = f"no exact KL: {why or 'no room for the full logprobs'}"
        return row
    try:
        with ctx.pool.device_turn(ctx.waiter(cfg.dtype), what=cfg.name):
            load, reps = speed["load"], speed["repeats"]
            n_load = sum(len(x) - 1 for x in load)
            ctx.emit("frontier", cfg.dtype, f"{cfg.name}: speed on {speed['words']}, {reps} times, warm")
            vllm.call("bare_prefill", load, 1, True)  # warm-up: the first calls after a start pay for lazy set-up
            vllm.generate(load[:2], GEN_TOKENS)
            prefill_s = []
            for r in range(reps):  # progress moves with each timed repeat (progress_steps counts them)
                ctx.emit("frontier", cfg.dtype, f"{cfg.name}: prefill speed, repeat {r + 1} of {reps}")
                prefill_s.append(vllm.call("bare_prefill", load, 1, True))
            gen_s = []
            for r in range(reps):
                ctx.emit("frontier", cfg.dtype, f"{cfg.name}: generation speed, repeat {r + 1} of {reps}")
                t = time.perf_counter()
                vllm.generate(load, GEN_TOKENS)
                gen_s.append(time.perf_counter() - t)
            ctx.emit("frontier", cfg.dtype, f"{cfg.name}: accuracy against HF in float64")
            vscores = vllm.score(seqs, 1)
            vllm.score(seqs, 1, None, None, "right", vfolder)  # its full logprobs, for the exact KL
            kl_why = fullvocab.problem(vfolder)  # then its gaps are still measured, its KL is not
            ref_v = ref.score(seqs, 1, None, None, "right", None if kl_why else vfolder)
            hkey = cfg.dtype + (" tf32" if settings.tf32 else "")  # the HF settings a configuration can change
            if hkey not in hf_gap:
                hf_scores = hf.score(seqs, 1)
                hf.write_full(seqs, hfolder)
                hf_gap[hkey] = _gap(ref.score(seqs, 1, None, None, "right", hfolder), hf_scores)
        row["ref_gap"] = _gap(ref_v, vscores)
        if kl_why:
            row["ref_gap"]["kl_why"] = f"vLLM's full logprobs could not be read: {kl_why}"
        row["hf_ref_gap"] = hf_gap[hkey]
        n_gen = GEN_TOKENS * len(load)
        row["tokens_per_s"] = {
            "prefill": n_load / float(np.median(prefill_s)),
            "generate": n_gen / float(np.median(gen_s)),
            "prefill_spread": [n_load / max(prefill_s), n_load / min(prefill_s)],
            "generate_spread": [n_gen / max(gen_s), n_gen / min(gen_s)],
            "repeats": reps,
            "load": speed["words"],
        }
        info = vllm.info or {}
        row["memory"] = {k: info.get(k) for k in ("weights_bytes", "kv_bytes_per_token", "kv_cache_bytes")}
    except EngineError as exc:
        if not str(exc).startswith(vllm.label):  # HF's or the reference's failure is not this configuration's
            raise
        # vLLM loaded it but failed at its first forward (a kernel this build lacks for this processor):
        # the other configurations are still measured, and this one's row says why
        lease.discard(vreq)
        row["skipped"] = f"vLLM could not run it: {str(exc).splitlines()[0][:300]}"
    finally:
        fullvocab.remove(vfolder)
        fullvocab.remove(hfolder)
    return row


def frontier_table(result: FrontierResult) -> list[dict[str, Any]]:
    """One row a configuration, in words and full precision (the page and the CLI show it)."""
    out = []
    for c in result.configs:
        g, h, tps = c["ref_gap"] or {}, c["hf_ref_gap"] or {}, c["tokens_per_s"] or {}
        mem = c.get("memory") or {}
        spread = tps.get("prefill_spread")
        out.append(
            {
                "configuration": c["name"],
                "mean |Δ logp| to float64": g.get("mean"),
                "max": g.get("max"),
                "exact KL to float64": g.get("kl_mean"),
                "HF in that dtype: mean |Δ|": h.get("mean"),
                "prefill tokens/s": tps.get("prefill"),
                "prefill spread": f"{spread[0]:,.0f}-{spread[1]:,.0f}" if spread else "",
                "generate tokens/s": tps.get("generate"),
                "weights GiB": mem["weights_bytes"] / 2**30 if mem.get("weights_bytes") else None,
                "KV bytes/token": mem.get("kv_bytes_per_token"),
                "engine start s": c.get("start_s"),
                "on the front": c.get("pareto", False),
                "skipped": c["skipped"] or "",
            }
        )
    return out


def frontier_text(result: FrontierResult) -> str:
    rows = frontier_table(result)
    head = [
        "configuration",
        "mean|Δ|",
        "max|Δ|",
        "KL",
        "HF mean|Δ|",
        "prefill tok/s",
        "spread",
        "gen tok/s",
        "weights GiB",
        "KV B/tok",
        "start s",
        "front",
    ]
    lines = []
    for r in rows:
        if r["skipped"]:
            lines.append([r["configuration"], f"skipped: {r['skipped']}"] + [""] * (len(head) - 2))
            continue
        f = lambda v, s="e": "-" if v is None else (f"{v:.3e}" if s == "e" else f"{v:,.0f}")  # noqa: E731
        lines.append(
            [
                r["configuration"],
                f(r["mean |Δ logp| to float64"]),
                f(r["max"]),
                f(r["exact KL to float64"]),
                f(r["HF in that dtype: mean |Δ|"]),
                f(r["prefill tokens/s"], "d"),
                r["prefill spread"] or "-",
                f(r["generate tokens/s"], "d"),
                "-" if r["weights GiB"] is None else f"{r['weights GiB']:.2f}",
                f(r["KV bytes/token"], "d"),
                "-" if r["engine start s"] is None else f"{r['engine start s']:.1f}",
                "yes" if r["on the front"] else "",
            ]
        )
    widths = [
        max(len(str(x[i])) for x in [head] + [ln for ln in lines if not ln[1].startswith("skipped")]) for i in range(len(head))
    ]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for ln in lines:
        out.append(
            "  ".join(str(c).ljust(w) for c, w in zip(ln, widths)) if not ln[1].startswith("skipped") else f"{ln[0]}  {ln[1]}"
        )
    out += [f"{c['name']}: no exact KL: {c['ref_gap']['kl_why']}" for c in result.configs if (c["ref_gap"] or {}).get("kl_why")]
    rec = result.recommendation
    tol = result.tolerance
    sp = result.speed or {}
    out += [
        "",
        f"speed: vLLM on {sp['load']}, warm, median of {sp['repeats']} (spread: slowest-fastest)"
        if sp
        else "speed: on the texts above (a frontier stored before the speed load)",
        f"tolerance: {tol['value']:.3e} ({tol['source']})" if tol["value"] is not None else "tolerance: none",
        f"recommendation: {rec['name'] or 'none'}: {rec['why']}",
        f"frontier {result.frontier_id}",
    ]
    return "\n".join(out)
