"""The pipeline: tokenize once, score the same ids with both engines, compare, store."""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from logprob_parity.analysis import batch, floors, turns
from logprob_parity.analysis.cluster import Job, words_left
from logprob_parity.analysis.request import Context, EventFn, Prepared, prepare, say_loading
from logprob_parity.analysis.verdict import run_verdicts
from logprob_parity.engines import fullvocab
from logprob_parity.engines.pool import Lease
from logprob_parity.engines.routing import routing_summary
from logprob_parity.env import device_name, versions
from logprob_parity.inputs.models import ResolvedModel
from logprob_parity.inputs.spec import RunSpec, content_hash
from logprob_parity.inputs.tokens import TokenizedText
from logprob_parity.results.bands import metrics_band_stats
from logprob_parity.results.metrics import concat, exact_kl_stats, summarize
from logprob_parity.results.positions import METRIC_COLUMNS, metrics_of
from logprob_parity.results.records import RunMeta, SequenceInfo
from logprob_parity.results.run import SCHEMA_VERSION, Run, StoredSequences
from logprob_parity.results.store import Store

BACKEND_ORDER = ("vllm", "hf")  # vLLM first: HF then gathers its own values on vLLM's top-k ids
NULL_BACKEND = "hf_null"  # in vLLM's role in a null comparison: HF against itself (engines.backends.hf.HFNullBackend)
NULL_WHY = "a null comparison (HF against itself) has no vLLM rows to take the exact KL from"


def engine_requests(p: Prepared, dtype: str) -> list[Any]:
    """The engines of one dtype in BACKEND_ORDER's roles: vLLM's role is played by HF itself in a null
    comparison (spec.null), so the same view and verdict show what noise looks like."""
    return [p.load(NULL_BACKEND if (p.spec.null and b == "vllm") else b, dtype) for b in BACKEND_ORDER]


def _identity(spec: RunSpec, model: ResolvedModel, dtype: str, device: str) -> dict[str, Any]:
    v = versions()
    return {
        "schema": SCHEMA_VERSION,
        "model": model.identity,
        "dtype": dtype,
        "backends": sorted(spec.backends),
        "settings": spec.settings.run_id_part(),
        "top_k": spec.top_k,
        "bos": spec.bos,
        "versions": {k: v[k] for k in ("torch", "transformers", "vllm")},
        "device": device_name(device),
        # the floor's definition is part of what a run holds: another definition, another run
        **({"noise_floor": floors.DEFINITION} if spec.noise_floor else {"noise_floor": False}),
        **({"null": NULL_BACKEND + ":chunked_kv"} if spec.null else {}),  # HF against itself: another run than the comparison
        "routing": batch.ROUTING_TOKENS,  # an MoE model's routes are compared on this many positions
    }


def request_key(spec: RunSpec, model: ResolvedModel, dtype: str, device: str) -> str:
    """Hash of the request before tokenizing: the same request maps to the same stored run."""
    return content_hash({**_identity(spec, model, dtype, device), "texts": list(spec.texts), "truncate": spec.truncate}, 32)


def run_id_for(
    spec: RunSpec, model: ResolvedModel, dtype: str, device: str, toks: list[TokenizedText], max_model_len: int
) -> str:
    """Content address: everything that can change a number, the token ids included."""
    return run_id_for_ids(spec, model, dtype, device, [t.text for t in toks], [list(t.token_ids) for t in toks], max_model_len)


def run_id_for_ids(
    spec: RunSpec, model: ResolvedModel, dtype: str, device: str, texts: list[str], ids: list[list[int]], max_model_len: int
) -> str:
    """`run_id_for` from the texts as scored and their ids (no token names or pieces needed)."""
    return content_hash(
        {
            **_identity(spec, model, dtype, device),
            "texts": list(texts),
            "token_ids": [list(x) for x in ids],
            "max_model_len": max_model_len,
        }
    )


_inflight_lock = threading.Lock()
_inflight: dict[str, threading.Lock] = {}


def _request_lock(key: str) -> threading.Lock:
    """One lock per request key: identical concurrent requests compute once, the rest wait and read the store."""
    with _inflight_lock:
        return _inflight.setdefault(key, threading.Lock())


def compare(
    spec: RunSpec,
    ctx: Context | None = None,
    use_cache: bool = True,
    *,
    store: Store | None = None,
    on_event: EventFn | None = None,
    model_roots: list[str] | None = None,
) -> list[Run]:
    """One stored Run per dtype, in spec order. Cached runs come back without starting an engine.

    ctx carries the store, the allowed model roots and the progress callback; the keyword
    arguments build one when it is not given (model_roots None: anywhere, see logprob_parity.inputs.models).
    """
    ctx = ctx or Context.of(store=store, on_event=on_event, model_roots=model_roots)
    return compare_prepared(prepare(spec, ctx), use_cache)


def compare_prepared(p: Prepared, use_cache: bool = True) -> list[Run]:
    """`compare` for a request already through `prepare` (diagnostics reuse theirs)."""
    keys = {d: request_key(p.spec, p.model, d, p.device) for d in p.spec.dtypes}
    with ExitStack() as held:
        for key in sorted(keys.values()):  # a fixed order: no two requests deadlock
            held.enter_context(_request_lock(key))
        return _compare_locked(p, use_cache, keys)


def _compare_locked(p: Prepared, use_cache: bool, keys: dict[str, str]) -> list[Run]:
    ctx, spec = p.ctx, p.spec
    runs: dict[str, Run] = {}
    if use_cache:
        for d, key in keys.items():
            rid = ctx.store.lookup_request(key)
            if rid:
                runs[d] = ctx.store.load(rid)
                ctx.emit("cache", d, f"run {rid} from the store, no engine started")
    todo = [d for d in spec.dtypes if d not in runs]
    if not todo:
        return [runs[d] for d in spec.dtypes]

    ctx.emit("tokenize", None, f"{len(spec.texts)} text(s)")
    p.seqs  # noqa: B018 - tokenize now: bad input fails before any engine starts
    plan = {d: engine_requests(p, d) for d in todo}
    # a dtype whose two engines do not fit together runs them in turn; a model vLLM cannot serve alone
    # is refused here, in words, before any engine starts
    fits = {d: turns.fit_of(p, *plan[d], keep=[r for pair in plan.values() for r in pair]) for d in todo}
    side = [d for d in todo if not fits[d].in_turn]
    everything = [r for d in side for r in plan[d]]
    # Every engine at once when they all fit (they load side by side); otherwise dtype after dtype.
    if ctx.pool.fits_together(everything):
        steps = [(side, everything)] if side else []
    else:
        steps = [([d], plan[d]) for d in side]
    if ctx.ray is not None:  # the engines run on a Ray cluster's workers; this process stores the parts
        from logprob_parity.analysis.cluster import open_cluster

        with open_cluster(ctx.ray, p) as cluster:
            for d in todo:
                runs[d] = _score_dtype(p, d, _OnCluster(p, d, cluster), keys[d], use_cache)
                ctx.emit("store", d, f"run {runs[d].run_id} saved")
        return [runs[d] for d in spec.dtypes]
    for dtypes, requests in steps:
        with ctx.pool.lease(requests, on_wait=ctx.waiter(dtypes[0])) as lease:
            for d in dtypes:
                runs[d] = _score_dtype(p, d, _Here(p, d, plan[d], lease), keys[d], use_cache)
                ctx.emit("store", d, f"run {runs[d].run_id} saved")
    for d in todo:
        if fits[d].in_turn:
            ctx.emit("plan", d, fits[d].words)
            runs[d] = _score_dtype(p, d, turns.InTurn(p, d, plan[d], fits[d]), keys[d], use_cache)
            ctx.emit("store", d, f"run {runs[d].run_id} saved")
    return [runs[d] for d in spec.dtypes]


BATCH_TOKENS_ENV = "LPP_BATCH_TOKENS"  # positions a batch scores at most (default: 65,536 on a GPU, 16,384 on a CPU)


def plan_batches(lengths: list[int], vocab: int | None, device: str, row_bytes: int | None = None) -> list[tuple[int, int]]:
    """Consecutive sequences [lo, hi) a batch: at most BATCH_TOKENS_ENV positions, and at most the
    exact KL's rows one batch may keep (logprob_parity.engines.fullvocab.batch_bytes), always at least one
    sequence; row_bytes: a bound of its own, in place of the device's (the files of engines in turn,
    which with a sample keep only some rows of a batch). The same lengths on
    the same machine always give the same plan, which is what lets a killed run find its finished
    batches again."""
    cap = int(os.environ.get(BATCH_TOKENS_ENV) or (65536 if device.startswith("cuda") else 16384))
    if vocab:
        rows = fullvocab.batch_bytes(device) if row_bytes is None else row_bytes
        cap = min(cap, max(1, rows // (4 * vocab)))
    out, lo, used = [], 0, 0
    for i, n in enumerate(lengths):
        rows = max(n - 1, 1)
        if i > lo and used + rows > cap:
            out.append((lo, i))
            lo, used = i, 0
        used += rows
    out.append((lo, len(lengths)))
    return out


def _score_dtype(p: Prepared, dtype: str, engines: Any, request_key: str, use_cache: bool) -> Run:
    """Score, compare and store one dtype, a batch at a time: each batch's table is stored as it
    finishes (with more than one batch, or on a Ray cluster), so memory is bounded by a batch and a
    killed run, started again with the same request, computes only the batches it lacks. `engines`
    scores the batches: this process's lease (_Here) or a Ray cluster's workers (_OnCluster)."""
    ctx, spec, store = p.ctx, p.spec, p.ctx.store
    t0 = time.perf_counter()
    seqs = p.seqs
    mml = p.max_model_len
    rid = run_id_for_ids(spec, p.model, dtype, p.device, p.texts, seqs, mml)
    n_floor = floors.sample_of(seqs, p.device)
    batches = plan_batches([len(s) for s in seqs], p.model.vocab_size, p.device, getattr(engines, "row_bytes", None))
    many = len(batches) > 1 or engines.many
    if not use_cache:
        store.drop_partial(rid)
    timing: dict[str, float] = {"vllm_load_s": 0.0, "hf_load_s": 0.0, "vllm_score_s": 0.0, "hf_score_s": 0.0, "noise_s": 0.0}
    parts: dict[int, dict[str, Any]] = {}  # batch -> its part's info (stored now or by an earlier run)
    tables: list[Any] = []  # the one batch's table when there is one batch
    metrics = None
    total = sum(len(s) - 1 for s in seqs)
    done = reused = 0
    jobs = []
    for b, (lo, hi) in enumerate(batches):
        n_pos = sum(len(x) - 1 for x in seqs[lo:hi])
        digest = content_hash([list(x) for x in seqs[lo:hi]], 16)
        old = store.part_info(rid, b) if many else None
        if old is not None and (old.get("lo"), old.get("hi"), old.get("ids")) == (lo, hi, digest):
            parts[b] = old
            done += n_pos
            reused += 1
            continue
        # the floor is measured on the run's first texts (floors.sample_of): beside the first batch's
        # table when that batch holds them all, else once every batch is scored
        with_floor = spec.noise_floor and b == 0 and hi >= n_floor
        jobs.append(Job(b, (dtype, b, lo, hi, len(batches), with_floor, digest), n_pos))

    def stored(job: Job, result: tuple[Any, dict[str, Any], Any], worker: int) -> None:
        nonlocal tables, metrics
        table, info, m = result
        if many:
            store.save_part(rid, job.key, table, info)
        else:
            tables, metrics = [table], m
        parts[job.key] = info
        for k in timing:
            timing[k] += info["timing"].get(k, 0.0)

    engines.parts(jobs, stored, dtype, total, done, reused)
    floor = next((parts[b].get("floor") for b in sorted(parts) if parts[b].get("floor")), None)
    seq_infos = [SequenceInfo.from_dict(x) for b in sorted(parts) for x in parts[b]["sequences"]]
    kl_why: dict[str, int] = {}  # why the exact KL is missing -> how many batches
    via: set[str] = set()
    infos: dict[str, Any] = {}
    for b in sorted(parts):
        infos = infos or parts[b].get("engines", {})
        for why, k in (parts[b].get("kl_why") or {}).items():
            kl_why[why] = kl_why.get(why, 0) + k
        via.update(parts[b].get("via") or [])
    if spec.noise_floor and floor is None and many:
        cols = ["seq", "hf_logprob", "vllm_logprob", "hf_topk_ids"]
        rows = store.part_table(rid, 0, cols) if batches[0][1] >= n_floor else None
        if rows is None:
            import pyarrow as pa

            rows = pa.concat_tables([store.part_table(rid, k, cols) for k, (lo, _) in enumerate(batches) if lo < n_floor])
        seq_col = rows.column("seq").to_numpy()
        top = rows.column("hf_topk_ids").to_pylist()  # HF's argmax ids: the floor counts HF's own flips
        main = {
            side: [
                _Scored(
                    rows.column(f"{side}_logprob").to_numpy()[seq_col == i],
                    np.array([t[0] if t else -1 for t, s in zip(top, seq_col) if s == i]) if side == "hf" else None,
                )
                for i in range(n_floor)
            ]
            for side in ("hf", "vllm")
        }
        floor, timing["noise_s"] = engines.floor(seqs[:n_floor], main)
    t_routing = time.perf_counter()
    routing, per_seq = engines.routing(seqs)
    if routing.get("measured"):
        timing["routing_s"] = time.perf_counter() - t_routing
    for i, r in enumerate(per_seq):
        seq_infos[i] = replace(seq_infos[i], routing=r)
    if reused:
        ctx.emit(
            "cache",
            dtype,
            f"{reused} of {len(batches)} batches came from the store (an earlier run of this request "
            f"stopped before it finished); {len(batches) - reused} computed now",
        )
    ctx.emit("compare", dtype, "metrics over every position")
    if many:
        metrics = concat([metrics_of(store.part_table(rid, b, list(METRIC_COLUMNS))) for b in range(len(batches))])
    summary = summarize(metrics)
    sampled = bool(getattr(engines, "samples", None))  # in turn past the spool's bound: the KL of a sample of positions
    if sampled:
        kl = np.asarray(metrics.kl_full, dtype=np.float64)
        summary.update(exact_kl_stats(kl[np.isfinite(kl)]))
    summary.update(floors.with_ratio(floor, summary["mean_abs_delta"]))
    summary.update(metrics_band_stats(metrics, summary, dtype))
    if routing.get("measured"):
        summary.update(routing_summary(per_seq))
    if kl_why:
        kl_full = "not computed: " + "; ".join(
            f"{why}" + (f" ({k} of {len(batches)} batches)" if many else "") for why, k in kl_why.items()
        )
    elif sampled:
        kl_full = engines.kl_words(total, summary.get("kl_full_mean"), summary.get("kl_full_mean_err"))
    else:
        runner = next(iter(via)) if len(via) == 1 else None
        kl_full = f"exact, every position{f' (from vLLM’s {runner} model runner)' if runner else ''}"
    infos = {
        **infos,
        "vllm": {
            **(infos.get("vllm") or {}),
            "kl_full": kl_full,
            "kl_transport": fullvocab.TRANSPORT_WORDS[fullvocab.transport(p.device)],
        },
    }
    meta = RunMeta(
        run_id=rid,
        **p.provenance(dtype, infos.get("hf") or {}, infos["vllm"]),
        backends=("hf", NULL_BACKEND) if spec.null else tuple(spec.backends),
        settings={**spec.settings.to_dict(), "max_model_len": mml},
        top_k=spec.top_k,
        bos=spec.bos,
        timing={
            **{k: round(x, 3) for k, x in timing.items()},
            "batches": len(batches),
            "batches_from_store": reused,
            **engines.timing_words(),
            "total_s": round(time.perf_counter() - t0, 3),
        },
        summary=summary,
        sequences=tuple(seq_infos),
        noise=floor or {},
        routing=routing,
    )
    # the comparison's own verdict, in its --json and report (its band counts are the summary's own)
    meta = replace(meta, verdict=run_verdicts([Run(meta=meta, sequences=())])[0].to_dict())
    out = tables if not many else (store.part_table(rid, b) for b in range(len(batches)))
    store.write_run(meta, out, request_key=request_key)
    store.drop_partial(rid)
    return Run(meta=meta, sequences=StoredSequences(store.path_of(rid), meta.sequences))


def _part(
    p: Prepared,
    dtype: str,
    requests: list[Any],
    lease: Lease,
    b: int,
    lo: int,
    hi: int,
    n_batches: int,
    with_floor: bool,
    digest: str,
) -> tuple[Any, dict[str, Any], Any]:
    """One batch scored by both engines, compared: (its table, its part's info, its metrics). The
    same function runs here and on a Ray worker, so both give the same numbers."""
    texts = p.seqs[lo:hi]
    described = batch.describe(p, lo, hi)
    scores, info_b, why_b, via_b = _score_batch(p, dtype, requests, lease, texts, b, n_batches)
    floor_job = batch.BESIDE.submit(batch.measure_floor, p, dtype, requests, lease, texts, scores) if with_floor else None
    return batch.assemble(p, lo, hi, digest, described, scores, info_b, why_b, via_b, floor_job)


class _Here:
    """Batches scored by this process's engines, under its lease."""

    many = False  # one batch is kept in memory, not stored as a part

    def __init__(self, p: Prepared, dtype: str, requests: list[Any], lease: Lease) -> None:
        self.p, self.dtype, self.requests, self.lease = p, dtype, requests, lease

    def parts(self, jobs: list[Job], on_done: Any, dtype: str, total: int, done: int, reused: int) -> None:
        computed, t_compute = 0, 0.0
        for job in jobs:
            t_b = time.perf_counter()
            on_done(job, _part(self.p, self.dtype, self.requests, self.lease, *job.args[1:]), 0)
            done += job.tokens
            computed += job.tokens
            t_compute += time.perf_counter() - t_b
            self.p.ctx.on_progress(dtype, done, total)
            n_batches = job.args[4]
            if n_batches > 1:
                rate = computed / t_compute if t_compute else 0.0
                left = (total - done) / rate if rate and done < total else 0.0
                self.p.ctx.on_status(dtype, {"done": done, "total": total, "unit": "tokens", "per_s": rate, "seconds_left": left})
                self.p.ctx.emit(
                    "batch",
                    dtype,
                    f"batch {job.key + 1} of {n_batches} done: {done:,} of {total:,} tokens, {rate:,.0f} tokens/s"
                    + (f", {words_left(left)}" if left else "")
                    + (f" ({reused} batch(es) were already in the store)" if reused else ""),
                )

    def floor(self, first: list[list[int]], main: dict[str, Any]) -> tuple[dict[str, Any], float]:
        return batch.measure_floor(self.p, self.dtype, self.requests, self.lease, first, main)

    def routing(self, seqs: list[list[int]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return _measure_routing(self.p, self.dtype, self.requests, self.lease, seqs)

    def timing_words(self) -> dict[str, Any]:
        return {}


class _OnCluster:
    """Batches scored by a Ray cluster's workers (logprob_parity.analysis.cluster): each runs `_part` on
    its own warm engines and sends back the part, which this process stores."""

    many = True  # every batch is a stored part: the driver's resume and memory bound, whatever the size

    def __init__(self, p: Prepared, dtype: str, cluster: Any) -> None:
        self.p, self.dtype, self.cluster = p, dtype, cluster

    def parts(self, jobs: list[Job], on_done: Any, dtype: str, total: int, done: int, reused: int) -> None:
        if reused:
            self.p.ctx.emit("cache", dtype, f"{reused} batch(es) already in the store; {len(jobs)} go to the workers")
        self.cluster.map(f"{__name__}:part_on_worker", jobs, on_done, dtype, total, done, batches=len(jobs) + reused)

    def floor(self, first: list[list[int]], main: dict[str, Any]) -> tuple[dict[str, Any], float]:
        return self.cluster.call(f"{__name__}:floor_on_worker", self.dtype, first, main, dtype=self.dtype, what="the noise floor")

    def routing(self, seqs: list[list[int]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self.cluster.call(f"{__name__}:routing_on_worker", self.dtype, seqs, dtype=self.dtype, what="the routing")

    def timing_words(self) -> dict[str, Any]:
        return {"ray_workers": len(self.cluster.workers), "ray_workers_alive": len(self.cluster.alive)}


def _worker_engines(p: Prepared, dtype: str) -> tuple[list[Any], Any]:
    requests = engine_requests(p, dtype)
    return requests, p.ctx.pool.lease(requests)


def part_on_worker(p: Prepared, *args: Any) -> tuple[Any, dict[str, Any], None]:
    """`_part` on a Ray worker's warm engines (the metrics are read back from the stored table)."""
    dtype = args[0]
    requests, lease = _worker_engines(p, dtype)
    with lease:
        table, info, _ = _part(p, dtype, requests, lease, *args[1:])
    return table, info, None


def floor_on_worker(p: Prepared, dtype: str, first: list[list[int]], main: dict[str, Any]) -> tuple[dict[str, Any], float]:
    requests, lease = _worker_engines(p, dtype)
    with lease:
        return batch.measure_floor(p, dtype, requests, lease, first, main)


def routing_on_worker(p: Prepared, dtype: str, seqs: list[list[int]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    requests, lease = _worker_engines(p, dtype)
    with lease:
        return _measure_routing(p, dtype, requests, lease, seqs)


@dataclass(frozen=True)
class _Scored:
    """A stored sequence's logprobs, as the floor reads a backend's scores (their `.logprob`), and HF's
    most likely id at each position (`.topk_ids`, one column: the floor counts HF's own argmax flips)."""

    logprob: Any
    topk_ids: Any = None


def _measure_routing(
    p: Prepared, dtype: str, requests: list[Any], lease: Lease, seqs: list[list[int]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """For an MoE model, the experts each layer picked for each token of the first texts (up to
    batch.ROUTING_TOKENS positions), on both sides, compared as sets (logprob_parity.engines.routing):
    (what was measured, each sequence's comparison). A dense model: {"measured": False, "why": ...}."""
    ctx = p.ctx
    vreq, hreq = requests
    n = batch.routing_texts(seqs)
    vhost, hhost = lease.host(vreq), lease.host(hreq)
    with ctx.pool.device_turn(ctx.waiter(dtype), what="the experts each token was routed to"):
        hf = lease.call(hreq, lambda: hhost.routes(seqs[:n]))
        if isinstance(hf, str):
            return {"measured": False, "why": hf}, []
        ctx.emit("routing", dtype, f"the experts each MoE layer picked for each token, on both sides, on {n} of the texts")
        vl = lease.call(vreq, lambda: vhost.routes(seqs[:n]))
    return batch.routes_compared(p, hf, vl, seqs)


def _score_null(
    p: Prepared,
    dtype: str,
    requests: list[Any],
    lease: Lease,
    seqs: list[list[int]],
    vhost: Any,
    hhost: Any,
    engines: dict,
    timing: dict,
) -> tuple[dict[str, list[Any]], dict[str, Any], str | None, set[str]]:
    """_score_batch of a null comparison: HF in vLLM's role scores the batch in its padded
    micro-batches, HF in its own role gathers its values on that side's top-k ids, as against vLLM."""
    ctx, spec = p.ctx, p.spec
    vreq, hreq = requests
    scores: dict[str, list[Any]] = {}
    with ctx.pool.device_turn(ctx.waiter(dtype), what="scoring"):
        ctx.emit("score", dtype, f"HF against itself (null): {sum(map(len, seqs)):,} tokens in padded micro-batches")
        t = time.perf_counter()
        scores["vllm"] = lease.call(vreq, lambda: vhost.score(seqs, spec.top_k))
        timing["vllm_score_s"] = time.perf_counter() - t
        gather = [s.topk_ids for s in scores["vllm"]]
        t = time.perf_counter()
        scores["hf"] = lease.call(hreq, lambda: hhost.score(seqs, spec.top_k, gather, None, "right", None))
        timing["hf_score_s"] = time.perf_counter() - t
    return scores, {"engines": engines, "timing": timing}, NULL_WHY, set()


def _score_batch(
    p: Prepared, dtype: str, requests: list[Any], lease: Lease, seqs: list[list[int]], b: int, n_batches: int
) -> tuple[dict[str, list[Any]], dict[str, Any], str | None, set[str]]:
    """Both engines on one batch, on one device turn, with the exact KL by this device's transport:
    (scores per backend, {"engines", "timing"}, why the KL is missing or None, the vLLM runner)."""
    ctx, spec = p.ctx, p.spec
    vreq, hreq = requests  # BACKEND_ORDER
    timing: dict[str, float] = {}
    engines: dict[str, Any] = {}
    hosts = {}
    for role, req in zip(BACKEND_ORDER, requests):  # keyed by role: HF plays vLLM's in a null comparison
        if b == 0:
            say_loading(ctx, dtype, lease, req, p.device)
        t = time.perf_counter()
        hosts[role] = lease.host(req)
        engines[role] = hosts[role].info
        timing[f"{role}_load_s"] = time.perf_counter() - t
    vhost, hhost = hosts["vllm"], hosts["hf"]
    if spec.null:
        return _score_null(p, dtype, requests, lease, seqs, vhost, hhost, engines, timing)
    where = batch.batch_words(b, n_batches)
    ex = fullvocab.Exchange(sum(len(s) - 1 for s in seqs), p.model.vocab_size, p.device)
    scores: dict[str, list[Any]] = {}
    try:
        with ctx.pool.device_turn(ctx.waiter(dtype), what="scoring"):
            scores["vllm"], timing["vllm_score_s"] = batch.vllm_side(p, dtype, vreq, lease, vhost, seqs, ex, where)
            scores["hf"], timing["hf_score_s"] = batch.hf_side(p, dtype, hreq, lease, hhost, seqs, ex, scores["vllm"], where)
    finally:
        ex.close(vhost)
    return scores, {"engines": engines, "timing": timing}, ex.why, {ex.runner} if ex.runner else set()
