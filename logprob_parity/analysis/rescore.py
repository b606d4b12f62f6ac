"""Rescore rollouts someone else sampled: their logged logprobs against vLLM prefill and HF.

An RL run already has its rollouts: prompt and completion ids with the logprobs its rollout engine
returned (logprob_parity.inputs.rollout_logs). Here they take the decode row (`decode_raw`, and
`decode_processed` too, the logger's values being whichever its engine returned), vLLM prefill and HF
(the trainer's side, at each record's temperature, with the mass its top-k/top-p keep) rescore the same
ids, in batches of sequences, and the result is a Rollout like `rollout`'s: the same pairs, RL
mismatch metrics, floors (HF's own; there is no decoding here to re-run), verdict, store entry,
page, report and `--json`.

Memory is bounded by a batch, not the file (up to 100,000 sequences):
- the file is read once, a line or row group at a time; each record is checked and staged in an
  Arrow file (logprob_parity.inputs.rollout_logs.stage_logged), and batches read their sequences back from it;
- each finished batch is stored at once as a part holding its final rows (pieces, prompts and all),
  so a rescore killed part way and started again on the same file computes only the batches it lacks
  and says how many came from the store;
- the summary is computed from the parts, read twice (logprob_parity.results.totals), and the stored file is
  written from them a window of sequences at a time, in sequence order;
- the Rollout returned reads its samples from that file when asked (logprob_parity.results.rollout.StoredSamples).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.analysis import floors as floors_def
from logprob_parity.analysis import turns
from logprob_parity.analysis.cluster import Job
from logprob_parity.analysis.compare import plan_batches, words_left
from logprob_parity.analysis.request import Context, model_max_len, prepare, say_loading
from logprob_parity.analysis.rollout import INCREMENTAL_TOKENS, with_trainer_defaults
from logprob_parity.analysis.verdict import rollout_verdict
from logprob_parity.engines import fullvocab
from logprob_parity.engines.records import LoadRequest
from logprob_parity.env import device_name, versions
from logprob_parity.errors import UserError
from logprob_parity.inputs.rollout_logs import LoggedIndex, LoggedSequence, stage_logged
from logprob_parity.inputs.spec import RunSpec, content_hash
from logprob_parity.inputs.tokens import decode_tail_pieces
from logprob_parity.results.offpolicy import floor_stats
from logprob_parity.results.rollout import (
    COLUMNS,
    EXACT,
    MAIN_PAIR,
    PAIRS,
    ROLLOUT_SCHEMA,
    Rollout,
    RolloutMeta,
    Sample,
    sample_table,
    with_bands,
)
from logprob_parity.results.totals import ExactTotals, streamed_summary

PART_LAYOUT = 2  # what a stored part holds (2: the final rows of its sequences); parts of another layout are recomputed
WINDOW_SEQUENCES = 4096  # the stored file is written a window of consecutive sequences at a time: at most this many,
WINDOW_TOKENS = 262_144  # and about this many completion tokens (batches never cross a window)
NOISE_SEQUENCES = 2  # logged sequences HF rescores again in micro-batches, in chunks and token by token
PROCESSED_WORDS = (
    "the logged values: the rollout engine's own logprobs, raw or processed as its logger wrote them (vLLM's default is raw)"
)


def rescore(
    source: bytes | Path,
    name: str,
    spec: RunSpec,
    ctx: Context | None = None,
    mapping: dict[str, str] | None = None,
    use_cache: bool = True,
    noise_sequences: int = NOISE_SEQUENCES,
) -> list[Rollout]:
    """One stored Rollout per dtype of `spec` for the logged rollouts in `source` (the file, or its
    bytes: an upload), `name` its file name. Every record is checked before any engine starts; stored
    ones come back without an engine. `spec.texts` is not used (the prompts come from the file)."""
    ctx = ctx or Context.of()
    spec = with_trainer_defaults(spec)
    p = prepare(dataclasses.replace(spec, texts=(f"logged rollouts from {name}",)), ctx)
    ctx.emit("tokenize", None, f"reading and checking the records of {name}")
    staged = ctx.store.new_staged()
    try:
        logged = stage_logged(source, name, mapping or {}, p.tokenizer, p.spec.bos, p.model.vocab_size, staged)
        longest = int((logged.prompt_len + logged.completion_len).max())
        if p.model.max_positions is not None and longest > p.model.max_positions:
            raise UserError(f"a logged sequence is {longest} tokens but {p.model.name} has {p.model.max_positions} positions")
        ctx.emit("tokenize", None, f"{len(logged):,} records checked: {logged.n_tokens:,} logged completion tokens")
        out = []
        for dtype in p.spec.dtypes:
            rid = content_hash(
                {
                    "schema": ROLLOUT_SCHEMA,
                    "kind": "rescore",
                    "model": p.model.identity,
                    "dtype": dtype,
                    "settings": p.spec.settings.run_id_part(),
                    "bos": p.spec.bos,
                    "logged": logged.digest,
                    "noise": noise_sequences,
                    **({"noise_floor": floors_def.DEFINITION} if noise_sequences else {}),
                    "versions": {k: versions()[k] for k in ("torch", "transformers", "vllm")},
                    "device": device_name(p.device),
                }
            )
            if use_cache and ctx.store.has_rollout(rid):
                ctx.emit("cache", dtype, f"rescore {rid} from the store, no engine started")
                out.append(ctx.store.load_rollout(rid))
                continue
            if not use_cache:
                ctx.store.drop_partial(rid)
            _rescore_dtype(p, logged, dtype, rid, model_max_len(longest, p.model.max_positions), noise_sequences)
            ctx.store.drop_partial(rid)
            ctx.emit("store", dtype, f"rescore {rid} saved")
            # read back from its file (memory bounded by the batch), but computed now: the page says so
            out.append(dataclasses.replace(ctx.store.load_rollout(rid), from_store=False))
        return out
    finally:
        staged.unlink(missing_ok=True)


def _windows(logged: LoggedIndex) -> list[tuple[int, int]]:
    """Consecutive sequences [lo, hi): at most WINDOW_SEQUENCES and about WINDOW_TOKENS completion tokens."""
    out, lo, used = [], 0, 0
    for i, n in enumerate(logged.completion_len.tolist()):
        if i > lo and (i - lo >= WINDOW_SEQUENCES or used + n > WINDOW_TOKENS):
            out.append((lo, i))
            lo, used = i, 0
        used += n
    out.append((lo, len(logged)))
    return out


def _batches(logged: LoggedIndex, vocab: int | None, device: str) -> list[tuple[int, list[int]]]:
    """(window, sequence numbers) a batch, in window order: within a window the sequences sampled
    alike (temperature, top-p, top-k) form groups, which HF rescores at once, cut by plan_batches."""
    out = []
    whole = (logged.prompt_len + logged.completion_len).tolist()
    for w, (lo, hi) in enumerate(_windows(logged)):
        groups: dict[tuple[float, float, int], list[int]] = {}
        for i in range(lo, hi):
            groups.setdefault((float(logged.temperature[i]), float(logged.top_p[i]), int(logged.top_k[i])), []).append(i)
        for g in groups.values():
            out.extend((w, g[a:b]) for a, b in plan_batches([whole[i] for i in g], vocab, device))
    return out


def _rescore_dtype(p: Any, logged: LoggedIndex, dtype: str, rid: str, mml: int, noise: int) -> None:
    """Score every batch (or find it stored), then the floors, the summary and the stored file. The
    batches run on this process's engines, or on a Ray cluster's workers (ctx.ray) that send each part
    back to be stored here."""
    ctx = p.ctx
    t_all = time.perf_counter()
    vreq, hreq = _requests(p, dtype, mml)
    if ctx.ray is not None:
        from logprob_parity.analysis.cluster import open_cluster

        with open_cluster(ctx.ray, p) as cluster:
            _rescore_with(p, logged, dtype, rid, mml, noise, _RescoreOnCluster(p, dtype, mml, cluster), t_all)
        return
    fit = turns.fit_of(p, vreq, hreq)  # refused here, in words, when vLLM alone cannot serve the model
    if fit.in_turn:
        ctx.emit("plan", dtype, fit.words)
    with ctx.pool.lease_for([vreq, hreq], fit.in_turn, on_wait=ctx.waiter(dtype)) as lease:
        for req in (vreq, hreq):
            say_loading(ctx, dtype, lease, req, p.device)
        here = _RescoreHere(p, dtype, mml, lease)
        if fit.in_turn:
            here.in_turn = {"engines": "in turn", "engines_why": fit.words}
            lengths = logged.prompt_len + logged.completion_len
            here.sample = turns.sample_for(
                (lengths - 1).tolist(),
                p.model.vocab_size,
                _token_ids(logged.read(range(min(8, len(logged))))),
                turns.group_positions() + int(lengths.max(initial=0)),
            )
            if here.sample:
                here.in_turn["kl_sample"] = turns.sample_where(here.sample)
        _rescore_with(p, logged, dtype, rid, mml, noise, here, t_all)


def _requests(p: Any, dtype: str, mml: int) -> tuple[LoadRequest, LoadRequest]:
    return (
        LoadRequest("vllm", p.model.path, dtype, p.device, p.spec.settings, mml),
        LoadRequest("hf", p.model.path, dtype, p.device, p.spec.settings, mml),
    )


def _rescore_with(p: Any, logged: LoggedIndex, dtype: str, rid: str, mml: int, noise: int, engines: Any, t_all: float) -> None:
    ctx = p.ctx
    timing = {"prefill_s": 0.0, "hf_s": 0.0}
    kl_why: set[str] = set()
    total, done, reused = logged.n_tokens, 0, 0
    store = ctx.store
    batches = _batches(logged, p.model.vocab_size, p.device)
    # the sequences the floors rescore: the noise sequences and the others that fill their micro-batch
    n_first = min(len(logged), noise + floors_def.OTHER_PROMPTS) if noise else 0
    first_hf: dict[int, np.ndarray] = {}  # and their HF logprobs in the rescore
    jobs: list[Job] = []
    engine_info: dict[str, Any] = {}

    def keep_first(b: int, idx: list[int], table: Any) -> None:
        wanted = [i for i in idx if i < n_first]
        if wanted:
            table = table if table is not None else store.part_table(rid, b, ["sample", "hf"])
            hf_col, seq_col = table.column("hf").to_numpy(), table.column("sample").to_numpy()
            first_hf.update({i: hf_col[seq_col == i] for i in wanted})

    for b, (_, idx) in enumerate(batches):
        n_tok = int(logged.completion_len[idx].sum())
        old = store.part_info(rid, b)
        if (
            old is not None
            and (old.get("idx"), old.get("layout")) == (idx, PART_LAYOUT)
            and old.get("ids") == _inputs(logged, dtype, mml, b, idx)[-1]
        ):
            if old.get("kl_why"):
                kl_why.add(old["kl_why"])
            reused += 1
            done += n_tok
            keep_first(b, idx, None)
            continue
        # the batch's sequences are read from the staged file when it is handed out: memory stays bounded by a batch
        jobs.append(Job(b, functools.partial(_inputs, logged, dtype, mml, b, idx), n_tok))

    def stored(job: Job, result: tuple[Any, dict[str, Any], dict[str, Any]], worker: int) -> None:
        table, info, extra = result
        store.save_part(rid, job.key, table, info)
        if info.get("kl_why"):
            kl_why.add(info["kl_why"])
        for k in timing:
            timing[k] += extra["timing"].get(k, 0.0)
        engine_info.update({k: v for k, v in extra["engines"].items() if k not in engine_info})
        keep_first(job.key, batches[job.key][1], table)

    engines.parts(jobs, stored, dtype, total, done, reused, len(batches))
    if reused:
        ctx.emit(
            "cache",
            dtype,
            f"{reused} of {len(batches)} batches came from the store (an earlier rescore of this file "
            f"stopped before it finished); {len(batches) - reused} computed now",
        )
    firsts = logged.read(range(n_first))
    full = _token_ids(firsts)
    floors, noise_timing, infos = engines.floors(
        full, [len(s.prompt_token_ids) for s in firsts], [first_hf[i] for i in range(n_first)], min(noise, len(logged))
    )
    timing.update(noise_timing)
    engine_info = engine_info or infos
    timing.update(batches=len(batches), batches_from_store=reused, **engines.timing_words())
    kl_words = "exact, every completion token of prefill_vs_hf" if not kl_why else "not computed: " + "; ".join(sorted(kl_why))
    sample = getattr(engines, "sample", None)
    engines_out = {
        "hf": engine_info.get("hf") or {},
        "vllm": {**(engine_info.get("vllm") or {}), "kl_full": kl_words, **getattr(engines, "in_turn", {})},
    }
    finish(p, logged, batches, dtype, rid, mml, floors, timing, engines_out, t_all, sample)


def _token_ids(seqs: list[LoggedSequence]) -> list[list[int]]:
    """Each logged sequence's ids as the engines score them: its prompt, then its completion."""
    return [list(s.prompt_token_ids) + list(s.completion_token_ids) for s in seqs]


def _inputs(logged: LoggedIndex, dtype: str, mml: int, b: int, idx: list[int]) -> tuple[Any, ...]:
    """A batch's job arguments, its sequences read from the staged file: (dtype, mml, b, idx, sequences,
    digest of their ids and logged values, which names the stored part)."""
    seqs = logged.read(idx)
    digest = content_hash([_token_ids(seqs), [s.logprobs for s in seqs]], 16)
    return (dtype, mml, b, idx, seqs, digest)


def _score_logged(
    p: Any, dtype: str, mml: int, lease: Any, b: int, idx: list[int], seqs: list[LoggedSequence]
) -> tuple[Any, Any, Any, dict[str, float]]:
    """Both engines on one batch of logged sequences, on one device turn: (vLLM prefill, HF, the KL
    exchange's why, timing)."""
    ctx = p.ctx
    vreq, hreq = _requests(p, dtype, mml)
    vllm, hf = lease.host(vreq), lease.host(hreq)
    batch = _token_ids(seqs)
    s0 = seqs[0]
    starts = [len(s.prompt_token_ids) for s in seqs]
    timing = {}
    with ctx.pool.device_turn(ctx.waiter(dtype), what="rescoring"):
        ex = fullvocab.Exchange(sum(len(f) - 1 for f in batch), p.model.vocab_size, p.device, getattr(lease, "transport", None))
        try:
            pre, timing["prefill_s"] = _vllm_logged(lease, vreq, vllm, batch, ex)
            got, timing["hf_s"] = _hf_logged(lease, hreq, hf, batch, starts, s0, ex)
        finally:
            ex.close(vllm)
    return pre, got, ex.why, timing


def _vllm_logged(lease: Any, vreq: LoadRequest, vllm: Any, batch: list[list[int]], ex: Any) -> tuple[Any, float]:
    """vLLM's prefill of a batch of logged sequences, its rows left for the exact KL; (scores, seconds)."""
    t = time.perf_counter()
    pre = lease.call(vreq, lambda: vllm.score(batch, 1, None, None, "right", ex.vllm_target))
    ex.after_vllm(vllm)
    return pre, time.perf_counter() - t


def _hf_logged(
    lease: Any, hreq: LoadRequest, hf: Any, batch: list[list[int]], starts: list[int], s0: LoggedSequence, ex: Any
) -> tuple[Any, float]:
    """HF's rescore of the same batch, with the exact KL against vLLM's rows; (scores, seconds)."""
    t = time.perf_counter()
    got = lease.call(hreq, lambda: hf.rollout_score(batch, starts, s0.temperature, s0.top_k, s0.top_p, None, ex.hf_source))
    return got, time.perf_counter() - t


def _part_of(
    p: Any,
    seqs: list[LoggedSequence],
    idx: list[int],
    digest: str,
    scored: tuple[Any, Any, Any, dict[str, float]],
    engines: dict[str, Any],
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A scored batch as its stored part: (table, the part's info, {"timing", "engines"})."""
    pre, got, why, timing = scored
    table = sample_table(_samples(p.tokenizer, seqs, idx, pre, got), idx)
    return table, {"idx": idx, "ids": digest, "kl_why": why, "layout": PART_LAYOUT}, {"timing": timing, "engines": engines}


def _engine_infos(p: Any, dtype: str, mml: int, lease: Any) -> dict[str, Any]:
    vreq, hreq = _requests(p, dtype, mml)
    return {"vllm": lease.host(vreq).info or {}, "hf": lease.host(hreq).info or {}}


class _RescoreHere:
    """Batches rescored by this process's engines. While the engines score a batch, a thread here
    builds and stores the part of the one before it (its pieces, prompt texts and Arrow table), so
    the engines do not wait on that work."""

    def __init__(self, p: Any, dtype: str, mml: int, lease: Any) -> None:
        self.p, self.dtype, self.mml, self.lease = p, dtype, mml, lease
        self.in_turn: dict[str, str] = {}  # the engine record's words when the engines ran in turn
        self.sample: tuple[int, int] | None = None  # in turn past the spool's bound: the exact KL's rows kept

    def parts(self, jobs: list[Job], on_done: Any, dtype: str, total: int, done: int, reused: int, n_batches: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        ctx = self.p.ctx
        computed, t0 = 0, time.perf_counter()
        engines: dict[str, Any] = {}  # read once both engines have scored (in turn, reading one takes no turn)

        def build(job: Job, args: tuple[Any, ...], scored: Any) -> None:
            nonlocal done, computed
            _, _, b, idx, seqs, digest = args
            engines.update(engines or _engine_infos(self.p, dtype, self.mml, self.lease))
            on_done(job, _part_of(self.p, seqs, idx, digest, scored, engines), 0)
            done += job.tokens
            computed += job.tokens
            ctx.on_progress(dtype, done, total)
            rate = computed / (time.perf_counter() - t0)
            left = (total - done) / rate if rate and done < total else 0.0
            ctx.on_status(dtype, {"done": done, "total": total, "unit": "logged tokens", "per_s": rate, "seconds_left": left})
            ctx.emit(
                "batch",
                dtype,
                f"batch {b + 1} of {n_batches} done: {done:,} of {total:,} logged tokens rescored, "
                f"{rate:,.0f} tokens/s"
                + (f", {words_left(left)}" if left else "")
                + (f" ({reused} batch(es) were already in the store)" if reused else ""),
            )

        if self.in_turn:
            self._in_turn(jobs, build)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpp-part") as beside:
            pending = None
            for job in jobs:
                args = job.inputs()
                _, mml, b, idx, seqs, _ = args
                scored = _score_logged(self.p, dtype, mml, self.lease, b, idx, seqs)
                if pending is not None:
                    pending.result()  # one part in the making at a time: memory stays bounded by two batches
                pending = beside.submit(build, job, args, scored)
            if pending is not None:
                pending.result()

    def _in_turn(self, jobs: list[Job], build: Any) -> None:
        """Engines in turn: vLLM prefills a group of batches (their rows wait in the spool's files, every
        row or `sample`'s), then HF finishes the group: two turns a group, not two a batch. The
        batches are the side-by-side run's, so are the values."""
        p, dtype, lease = self.p, self.dtype, self.lease
        vreq, hreq = _requests(p, dtype, self.mml)
        vllm, hf = lease.host(vreq), lease.host(hreq)
        plan = turns.groups([job.tokens for job in jobs], turns.group_positions())
        for g, idx in enumerate(plan):
            staged: list[tuple[Job, tuple[Any, ...], list[list[int]], Any, Any, float]] = []
            try:
                p.ctx.emit("turn", dtype, f"vLLM's turn: group {g + 1} of {len(plan)}, {len(idx)} batch(es)")
                for k in idx:
                    args = jobs[k].inputs()
                    seqs = args[4]
                    batch = _token_ids(seqs)
                    rows = sum(len(f) - 1 for f in batch)
                    kept = fullvocab.kept_of(batch, self.sample)
                    ex = fullvocab.Exchange(rows, p.model.vocab_size, p.device, lease.transport, sample=kept)
                    staged.append((jobs[k], args, batch, ex, *_vllm_logged(lease, vreq, vllm, batch, ex)))
                p.ctx.emit("turn", dtype, f"HF's turn: group {g + 1} of {len(plan)}, against the spool")
                for job, args, batch, ex, pre, prefill_s in staged:
                    seqs = args[4]
                    got, hf_s = _hf_logged(lease, hreq, hf, batch, [len(s.prompt_token_ids) for s in seqs], seqs[0], ex)
                    ex.close()
                    build(job, args, (pre, got, ex.why, {"prefill_s": prefill_s, "hf_s": hf_s}))
            finally:
                for item in staged:
                    item[3].close()

    def floors(
        self, full: list[list[int]], starts: list[int], one: list[np.ndarray], k: int
    ) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
        return rescore_floors(self.p, self.dtype, self.mml, self.lease, full, starts, one, k)

    def timing_words(self) -> dict[str, Any]:
        switches = getattr(self.lease, "switches", None)
        return {} if switches is None else {"turns": switches + 1}


class _RescoreOnCluster:
    """Batches rescored by a Ray cluster's workers (logprob_parity.analysis.cluster), each part stored here."""

    def __init__(self, p: Any, dtype: str, mml: int, cluster: Any) -> None:
        self.p, self.dtype, self.mml, self.cluster = p, dtype, mml, cluster

    def parts(self, jobs: list[Job], on_done: Any, dtype: str, total: int, done: int, reused: int, n_batches: int) -> None:
        if reused:
            self.p.ctx.emit("cache", dtype, f"{reused} batch(es) already in the store; {len(jobs)} go to the workers")
        self.cluster.map(f"{__name__}:part_on_worker", jobs, on_done, dtype, total, done, unit="logged tokens", batches=n_batches)

    def floors(
        self, full: list[list[int]], starts: list[int], one: list[np.ndarray], k: int
    ) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
        return self.cluster.call(
            f"{__name__}:floors_on_worker", self.dtype, self.mml, full, starts, one, k, dtype=self.dtype, what="the noise floors"
        )

    def timing_words(self) -> dict[str, Any]:
        return {"ray_workers": len(self.cluster.workers), "ray_workers_alive": len(self.cluster.alive)}


def part_on_worker(p: Any, dtype: str, mml: int, b: int, idx: list[int], seqs: list[LoggedSequence], digest: str) -> Any:
    """One batch on a Ray worker's warm engines, as its part (the same functions as here)."""
    with p.ctx.pool.lease(list(_requests(p, dtype, mml))) as lease:
        scored = _score_logged(p, dtype, mml, lease, b, idx, seqs)
        return _part_of(p, seqs, idx, digest, scored, _engine_infos(p, dtype, mml, lease))


def floors_on_worker(p: Any, dtype: str, mml: int, *args: Any) -> Any:
    with p.ctx.pool.lease(list(_requests(p, dtype, mml))) as lease:
        return rescore_floors(p, dtype, mml, lease, *args)


def rescore_floors(
    p: Any, dtype: str, mml: int, lease: Any, full: list[list[int]], starts: list[int], one: list[np.ndarray], k: int
) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """`_floors` on these engines: (the floors, their timing, the engines' records)."""
    timing: dict[str, float] = {}
    _, hreq = _requests(p, dtype, mml)
    floors = _floors(p.ctx, dtype, lease, hreq, lease.host(hreq), full, starts, one, k, timing)
    return floors, timing, _engine_infos(p, dtype, mml, lease)


def _samples(
    tokenizer: Any, seqs: list[LoggedSequence], idx: list[int], pre: list[Any], got: list[dict[str, np.ndarray]]
) -> list[Sample]:
    """One batch's scorings as Samples beside the logged values (checked: both engines scored exactly
    the logged completion ids)."""
    out = []
    for i, s, a, h in zip(idx, seqs, pre, got):
        n0, n = len(s.prompt_token_ids), len(s.completion_token_ids)
        if [int(x) for x in a.token_ids[n0:]] != list(s.completion_token_ids) or len(h["logprob"]) != n:
            raise AssertionError(f"record {s.record}: the scorings did not score the logged completion ids")
        logged_lp = np.asarray(s.logprobs, dtype=np.float64)
        lp = {
            "decode_raw": logged_lp,
            "decode_processed": logged_lp.copy(),
            "prefill": np.asarray(a.logprob[n0:], dtype=np.float64),
            "hf": np.asarray(h["logprob"], dtype=np.float64),
            "hf_tempered": np.asarray(h["tempered"], dtype=np.float64),
            "log_kept_mass": np.asarray(h["log_kept_mass"], dtype=np.float64),
        }
        exact = {
            "kl_full": np.asarray(h.get("kl_full", np.full(n, np.nan)), dtype=np.float64),
            "same_top": (np.asarray(a.topk_ids[n0:, 0]) == np.asarray(h["top_id"])).astype(np.float64),
        }
        full = [*s.prompt_token_ids, *s.completion_token_ids]
        out.append(
            Sample(
                prompt_index=i,
                seed=-1,
                prompt_token_ids=s.prompt_token_ids,
                completion_token_ids=s.completion_token_ids,
                pieces=tuple(decode_tail_pieces(tokenizer, full, n0)),
                finish_reason=f"logged record {s.record}"
                + (f", id {s.id}" if s.id else "")
                + (f", step {s.step}" if s.step is not None else ""),
                logprob=lp,
                exact=exact,
                prompt_text=tokenizer.decode(list(s.prompt_token_ids)),
            )
        )
    return out


def finish(
    p: Any,
    logged: LoggedIndex,
    batches: list[tuple[int, list[int]]],
    dtype: str,
    rid: str,
    mml: int,
    floors: dict[str, Any],
    timing: dict[str, Any],
    engines: dict[str, dict[str, Any]],
    t_all: float,
    sample: tuple[int, int] | None = None,
) -> None:
    """The stored rescore from its parts: the summary (two passes over the parts' columns), the
    verdict, and the file, written a window at a time in sequence order. Apart from the engines, so
    its cost can be measured alone (benchmarks/rescore_profile.py)."""
    import pyarrow as pa

    store = p.ctx.store
    t = time.perf_counter()

    def parts() -> Any:
        for b, (_, idx) in enumerate(batches):
            table = store.part_table(rid, b, [*COLUMNS, *EXACT])
            yield {**{c: table.column(c).to_numpy() for c in (*COLUMNS, *EXACT)}, "lengths": logged.completion_len[idx]}

    exact = ExactTotals(sampled=sample is not None)
    summary = streamed_summary(parts, PAIRS, "prefill_vs_hf", exact)
    if sample is not None and not engines["vllm"].get("kl_full", "").startswith("not computed"):
        # engines in turn past the spool's bound: the exact KL of a uniform sample of positions
        ex = summary["prefill_vs_hf"]
        engines["vllm"]["kl_full"] = turns.sample_words(
            exact.kl.n,
            int(logged.n_tokens),
            sample,
            "completion tokens of prefill_vs_hf",
            ex.get("kl_full_mean"),
            ex.get("kl_full_mean_err"),
        )
    a, b, _ = PAIRS[MAIN_PAIR]
    summary = with_bands(summary, floors, dtype, ((part[a], part[b]) for part in parts()))
    timing["summary_s"] = time.perf_counter() - t
    temps, top_ps, top_ks = (sorted(set(a.tolist())) for a in (logged.temperature, logged.top_p, logged.top_k))
    sampling = {
        "source": "logged",
        "file": logged.source,
        "records": len(logged),
        "samples": 1,
        "temperature": temps[0],
        "top_p": top_ps[0],
        "top_k": top_ks[0],
        "max_tokens": int(logged.completion_len.max()),
        "seed": None,
        "varies": len(temps) * len(top_ps) * len(top_ks) > 1,
        "digest": logged.digest,
    }
    meta = RolloutMeta(
        rollout_id=rid,
        **p.provenance(dtype, engines["hf"], engines["vllm"]),
        bos=p.spec.bos,
        settings={**p.spec.settings.to_dict(), "max_model_len": mml},
        sampling=sampling,
        prompts=(),
        processed=PROCESSED_WORDS,
        timing={k: round(x, 3) for k, x in {**timing, "total_s": time.perf_counter() - t_all}.items()},
        summary=summary,
        floors=floors,
    )
    meta = dataclasses.replace(meta, verdict=rollout_verdict(meta).to_dict())

    def tables() -> Any:
        by_window: dict[int, list[int]] = {}
        for b, (w, _) in enumerate(batches):
            by_window.setdefault(w, []).append(b)
        for w in sorted(by_window):
            table = pa.concat_tables([store.part_table(rid, b) for b in by_window[w]])
            yield table.take(np.argsort(table.column("sample").to_numpy(), kind="stable"))

    store.write_rollout(meta, tables(), len(logged))


def _floors(
    ctx: Any,
    dtype: str,
    lease: Any,
    hreq: LoadRequest,
    hf: Any,
    full: list[list[int]],
    starts: list[int],
    one: list[np.ndarray],
    k: int,
    timing: dict[str, float],
) -> dict[str, dict[str, Any]]:
    """HF's own noise on the first k logged sequences (`full`: the first few, `one`: HF's logprobs of
    the first k in the rescore): the floor's one definition (logprob_parity.analysis.floors: micro-batch,
    padding side, packed, chunked; the other logged sequences fill the batch, as a trainer's
    micro-batch holds other rollouts), and beside it one token a forward. No decode floor: nothing is
    decoded here."""
    if k == 0:
        return {}
    t = time.perf_counter()
    ctx.emit(
        "noise",
        dtype,
        f"HF's floor on {k} logged sequence(s): micro-batch, padding side, packed, chunked through its KV cache; and token by token",
    )
    base = [np.concatenate([np.full(s, np.nan), o]) for o, s in zip(one[:k], starts[:k])]
    others = [list(x) for x in full[k : k + floors_def.OTHER_PROMPTS]]
    with ctx.pool.device_turn(ctx.waiter(dtype), what="the noise floor"):
        variations, skipped = lease.call(
            hreq,
            lambda: floors_def.hf_variations(
                hf, full[:k], base, others, hreq.device, starts=starts[:k], hf_batch_size=hreq.settings.hf_batch_size
            ),
        )
        inc = lease.call(hreq, lambda: hf.rollout_score(full[:k], starts[:k], chunk=1, tail=INCREMENTAL_TOKENS))
    floors: dict[str, dict[str, Any]] = {}
    floors.update(floors_def.floor_rows(variations, skipped))
    floors["hf_incremental"] = {
        **floor_stats([c["logprob"] for c in inc], [o[int(c["first"]) - s :] for c, o, s in zip(inc, one[:k], starts[:k])]),
        "side": "hf",
        "tokens": INCREMENTAL_TOKENS,
        "what": f"HF: one token a forward through the KV cache vs one pass, the last {INCREMENTAL_TOKENS} tokens",
    }
    timing["noise_s"] = time.perf_counter() - t
    return floors
