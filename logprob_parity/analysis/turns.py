"""Engines in turn: vLLM and HF of a model too large for both to fit on the device at once.

Why: a comparison normally holds both engines of a dtype on the device together. A model larger than
about half the card (Qwen3-30B-A3B in bfloat16 on an 80 GB card) cannot be held twice, though vLLM
alone can serve it. RL frameworks meet the same wall and take turns (verl and TRL's colocate mode put
vLLM to sleep while the trainer holds the card); so does this.

How, for one dtype whose engines do not fit together (`fit_of`, from engines.memory.plan_fit):
- the batches of the run go in groups of at most LPP_TURN_POSITIONS positions (one group for most sets);
- vLLM scores every batch of a group, and what HF needs to finish each comparison is kept in the
  spool: vLLM's scores (target logprobs, top-k ids and values) in this process, and vLLM's full
  log-softmax rows for the exact KL as files on shared memory or disk (fullvocab's files transport,
  which outlives the vLLM host's turn);
- then HF takes the device: the pool, bound by the memory cap, puts the idle vLLM engine to sleep (a
  GPU) or stops it (a CPU), and HF scores the same batches against the spool;
- each batch is stored as a part as it finishes, so a killed run resumes like any other.

The spool's bound is LPP_SPOOL_BYTES (default 16 GB): a group never holds more rows than that. When
every row would not fit, vLLM keeps the rows of a uniform systematic sample of positions and the run
states the sample and the KL mean's standard error (`_sample_of_run`). The record's timing says
"engines in turn", why, how many turns, their seconds and the most the spool held.
"""

from __future__ import annotations

import os
import time
from typing import Any

from logprob_parity.analysis import batch
from logprob_parity.analysis.cluster import Job, words_left
from logprob_parity.analysis.request import Prepared, say_loading
from logprob_parity.engines import fullvocab, memory
from logprob_parity.inputs.sizes import consecutive
from logprob_parity.inputs.spec import content_hash

SPOOL_ENV = "LPP_SPOOL_BYTES"
SPOOL_DEFAULT = 16 * 10**9


def spool_bound() -> int:
    """The most bytes of vLLM's rows the spool may hold at once (LPP_SPOOL_BYTES, a size such as 16GB)."""
    value = os.environ.get(SPOOL_ENV)
    return memory.parse_size(value) if value else SPOOL_DEFAULT


def fit_of(p: Prepared, vllm: Any, hf: Any, keep: Any = ()) -> memory.Fit:
    """How one dtype's engines fit (engines.memory.plan_fit). A CPU without a cap is not sized at all:
    there the engines always ran side by side, and a model folder is not read twice for nothing.
    keep: the run's engines of its other dtypes, which `make_room` never stops for room."""
    if not p.device.startswith("cuda") and not (memory.cap_of(vllm.settings) or memory.cap_of(hf.settings)):
        return memory.Fit(False, "", 0, 0, 0)
    fit = memory.plan_fit(p.model.name, vllm, hf)
    if fit.in_turn:
        make_room(p, vllm, keep={hf.key(), *(r.key() for r in keep)})
    return fit


def make_room(p: Prepared, vllm: Any, free: dict[str, int] | None = None, keep: set[str] = frozenset()) -> None:
    """Refuse in words, before anything loads, a run in turn whose spool would not fit in shared
    memory or on disk, or (on a GPU) whose sleeping engine's weights would not fit in host memory
    (unless that engine is warm in the pool and has slept already: then they hold their room). The
    pool makes that room when idle engines of earlier runs that slept can give it (EnginePool.make_host_room).
    free: the free bytes of "spool" (the roomier of /dev/shm and the temp folder) and "host" (RAM), for tests.
    keep: the run's other engine keys, never stopped for room."""
    from logprob_parity.errors import UserError

    free = free if free is not None else {"spool": spool_room(), "host": memory.free_bytes("cpu")}
    rows = sum(len(s) - 1 for s in p.seqs) * 4 * (p.model.vocab_size or 0)
    spool = min(spool_bound(), rows)
    if spool > free["spool"]:
        raise UserError(
            f"engines in turn keep up to {memory.size_words(spool)} of vLLM's rows for the exact KL in a spool "
            f"(the bound is LPP_SPOOL_BYTES), but /dev/shm and the temp folder have {memory.size_words(free['spool'])} free; "
            "lower LPP_SPOOL_BYTES (past it the KL covers a sample of positions) or free some room"
        )
    # this engine warm in the pool and slept by a run before this one: its host memory is taken already
    # (asleep, its weights are there; woken, torch keeps the pinned blocks for its next sleep), and the
    # free bytes count without it. A warm engine that never slept still needs the room for its first sleep.
    warm = p.ctx.pool.host_for(vllm)
    held = warm is not None and warm.alive() and warm.slept
    if not p.device.startswith("cuda") or held:
        return
    weights = memory.weight_bytes(vllm.model_path, vllm.dtype)

    def stopping(n: int) -> None:
        what = (
            f"stopping {n} idle engine(s) of an earlier run, which hold host memory since they slept, to make room for this run's"
        )
        p.ctx.emit("plan", vllm.dtype, what)

    if p.ctx.pool.make_host_room(weights, free["host"], keep={vllm.key(), *keep}, on_stop=stopping) is None:
        raise UserError(
            f"engines in turn keep the sleeping engine's weights in host memory ({memory.size_words(weights)} in "
            f"{vllm.dtype}), but this machine has {memory.size_words(free['host'])} free"
        )


def spool_room() -> int:
    """Free bytes where the spool's files go: the roomier of /dev/shm and the temp folder."""
    import shutil
    import tempfile

    room = 0
    for base in ("/dev/shm", tempfile.gettempdir()):  # noqa: S108 - only its free space is read
        try:
            room = max(room, shutil.disk_usage(base).free)
        except OSError:
            continue
    return room


def in_turn_weights(
    model: str | None, dtypes: list[str], cap: str | None, roots: list[str] | None, device: str | None = None
) -> int:
    """For a form's estimate before Run: the weight bytes of the largest dtype whose engines would run
    in turn under this cap (0: side by side, no cap, or nothing readable yet). roots: the server's
    model roots (a folder outside them is not read). Never raises: a form redraws on every keystroke,
    and its run says what is wrong in words."""
    if not cap:
        return 0
    try:
        from logprob_parity.engines.records import LoadRequest
        from logprob_parity.env import resolve_device
        from logprob_parity.inputs.models import resolve_model
        from logprob_parity.inputs.settings import EngineSettings

        m = resolve_model(model, roots=roots)
        dev = device or resolve_device("auto")
        settings = EngineSettings(device_memory=cap)
        got = 0
        for d in dtypes:
            v, h = (LoadRequest(b, m.path, d, dev, settings) for b in ("vllm", "hf"))
            if memory.plan_fit(m.name, v, h).in_turn:
                got = max(got, memory.weight_bytes(m.path, d))
        return got
    except Exception:
        return 0


SAMPLE_ENV = "LPP_KL_SAMPLE"
SAMPLE_DEFAULT = 4096


def sample_positions() -> int:
    """About how many positions' rows the exact KL keeps past the spool's bound (LPP_KL_SAMPLE). 4,096
    rows of a 152k vocabulary are 2.5 GB to copy; the KL's mean is then known to about 1.6% of the
    positions' own spread (1/sqrt(4096)), and the run says its standard error."""
    return max(1, int(os.environ.get(SAMPLE_ENV) or SAMPLE_DEFAULT))


def sample_for(
    rows_each: list[int], vocab: int | None, ids: list[list[int]], group_rows: int | None = None
) -> tuple[int, int] | None:
    """None when every row of the spool (rows_each: each sequence's rows, at most group_rows of them
    at once) fits the spool's bound; else (stride, phase) of a uniform systematic sample of each
    sequence's positions: every stride-th row from row phase.

    The stride is the larger of the fewest whose rows fit the bound (at most one row more a sequence
    than rows/stride) and the one that keeps about LPP_KL_SAMPLE positions in all: copying rows is
    what engines in turn spend most on, and the mean's standard error, which the run states, shrinks
    only as the square root of the sample. The phase comes from the ids, so the same sequences give
    the same sample."""
    vocab = vocab or 0
    total = sum(rows_each)
    rows = total if group_rows is None else min(total, group_rows)
    bound = spool_bound()
    if not vocab or rows * 4 * vocab <= bound:
        return None
    row = 4 * vocab
    stride = max(2, -(-rows * row // bound), -(-total // sample_positions()))
    longest = max(rows_each, default=1)
    while (-(-rows // stride) + min(len(rows_each), rows)) * row > bound and stride <= longest:
        stride += 1
    phase = int(content_hash([list(x) for x in ids[:8]], 8), 16) % stride
    return stride, phase


def sample_where(sample: tuple[int, int]) -> str:
    """Which positions a sample keeps, in words."""
    stride, phase = sample
    return f"every {stride}th position of each text from position {phase + 1}"


def sample_words(kept: int, total: int, sample: tuple[int, int], what: str, mean: float | None, err: float | None) -> str:
    """How the exact KL of a sample reads in a run's record."""
    return (
        f"exact on a uniform sample of {kept:,} of {total:,} {what} ({sample_where(sample)}): vLLM's rows of every "
        f"position would not fit the spool's bound of {spool_bound() / 1e9:.3g} GB"
        + (f"; mean {mean:.4g} ± {err:.2g} (standard error)" if mean is not None and err is not None else "")
    )


GROUP_ENV = "LPP_TURN_POSITIONS"
GROUP_DEFAULT = 1 << 22  # positions a turn scores: their scores wait in this process (about 100 bytes each)


def group_positions() -> int:
    """The most positions one turn of vLLM scores before HF takes the device (LPP_TURN_POSITIONS)."""
    return int(os.environ.get(GROUP_ENV) or GROUP_DEFAULT)


def groups(sizes: list[int], bound: int) -> list[list[int]]:
    """Consecutive batches whose positions add up to at most `bound` (each group at least one batch):
    the batches one turn of vLLM scores before HF takes the device."""
    return consecutive(sizes, bound)


class InTurn:
    """A dtype's batches scored by vLLM and HF in turn (the `engines` of batch._score_dtype)."""

    many = True  # every batch is a stored part: a killed run resumes, and memory is bounded by a group

    def __init__(self, p: Prepared, dtype: str, requests: list[Any], fit: memory.Fit) -> None:
        self.p, self.dtype, self.requests, self.fit = p, dtype, requests, fit
        self.bound = spool_bound()
        # the sample of the exact KL's rows, decided from the whole run (None: every row)
        self.sample: tuple[int, int] | None = self._sample_of_run()
        # the most rows' bytes a batch is planned for: one batch of the files transport. With a sample
        # a batch keeps one row in stride and at most one more a text (half of it is left for those),
        # so it may span that many more positions: fewer, larger vLLM calls (the batch-token cap holds)
        self.row_bytes = fullvocab.MAX_BYTES // 2 * self.sample[0] if self.sample else fullvocab.MAX_BYTES
        self.turns = 0  # times an engine took the device from the other (vLLM's turns and HF's)
        self._last: int | None = None
        self.turn_s = 0.0  # seconds the pool took to give an engine the device (the other's sleep or stop)
        self.spool_max = 0  # the most bytes of rows the spool held at once
        self.spooled = 0
        self.samples: set[tuple[int, int]] = set()  # the sample taken (one a run), for the record
        # each engine's hosts and their sleep and wake seconds when first seen: the run's share of them
        self._hosts: dict[int, tuple[Any, dict[str, float]]] = {}
        self._vllm_routes: Any = None  # vLLM's routes, taken in its first turn (`routing`)
        for r in requests:
            self._see(r)
        self.kl_positions = 0  # positions whose rows the spool kept

    def _sample_of_run(self) -> tuple[int, int] | None:
        """The run's sample of the exact KL's rows (`sample_for`), the spool holding one group of
        batches at a time; decided from the whole run's texts, so a killed run started again samples
        the same positions."""
        p = self.p
        lengths = [len(s) - 1 for s in p.seqs]
        return sample_for(lengths, p.model.vocab_size, p.seqs, group_positions() + max(lengths, default=0))

    def kl_words(self, positions: int, mean: float | None, err: float | None) -> str | None:
        """The exact KL's words when a sample stood in for every position (None: every position)."""
        if not self.samples:
            return None
        (sample,) = self.samples
        return sample_words(self.kl_positions, positions, sample, "positions", mean, err)

    # -- turns ------------------------------------------------------------------------------------
    def _see(self, request: Any) -> None:
        host = getattr(self.p.ctx.pool, "host_for", lambda r: None)(request)
        if host is not None and id(host) not in self._hosts:
            self._hosts[id(host)] = (host, dict(getattr(host, "turn_seconds", {})))

    def _turn_seconds(self) -> dict[str, float]:
        """Seconds each engine spent leaving the device (sleep) and taking it back (wake) in this run."""
        out: dict[str, float] = {}
        for host, before in self._hosts.values():
            backend = host.request.backend if getattr(host, "request", None) is not None else "engine"
            for k, x in getattr(host, "turn_seconds", {}).items():
                key = f"{backend}_{k}_s"
                out[key] = round(out.get(key, 0.0) + x - before.get(k, 0.0), 3)
        return {k: x for k, x in out.items() if x}

    def _lease(self, which: int, what: str) -> Any:
        """The lease of one engine alone; the pool stops the other (idle) to make room under the cap."""
        ctx = self.p.ctx
        req = self.requests[which]
        if which != self._last:
            self.turns, self._last = self.turns + 1, which
        ctx.emit("turn", self.dtype, f"engines in turn: {req.backend} takes the device ({what})")
        t = time.perf_counter()
        lease = ctx.pool.lease([req], on_wait=ctx.waiter(self.dtype))  # the other engine sleeps or stops here
        self.turn_s += time.perf_counter() - t
        self._see(req)
        say_loading(ctx, self.dtype, lease, req, self.p.device)
        return lease

    def parts(self, jobs: list[Job], on_done: Any, dtype: str, total: int, done: int, reused: int) -> None:
        ctx = self.p.ctx
        vreq, hreq = self.requests
        plan = groups([job.tokens for job in jobs], group_positions())
        if self.sample:
            self.samples.add(self.sample)
        computed, t_compute = 0, 0.0
        for g, idx in enumerate(plan):
            t_g = time.perf_counter()
            group = [jobs[i] for i in idx]
            what = f"group {g + 1} of {len(plan)}: {len(group)} batch(es)" + (
                f", the exact KL's rows of every {self.sample[0]}th position" if self.sample else ""
            )
            spool: list[dict[str, Any]] = []
            try:
                with self._lease(0, what) as lease:
                    t = time.perf_counter()
                    vhost = lease.host(vreq)
                    load_s = time.perf_counter() - t
                    for job in group:
                        spool.append(self._vllm_turn(lease, vhost, job, load_s))
                        load_s = 0.0
                    if self._vllm_routes is None:  # an MoE model's routes while vLLM holds the device: no turn of their own
                        seqs = self.p.seqs[: batch.routing_texts(self.p.seqs)]
                        self._vllm_routes = lease.call(vreq, lambda h=vhost, s=seqs: h.routes(s))
                with self._lease(1, what + ", against the spool") as lease:
                    t = time.perf_counter()
                    hhost = lease.host(hreq)
                    load_s = time.perf_counter() - t
                    for item in spool:
                        job = item["job"]
                        on_done(job, self._hf_turn(lease, hhost, item, load_s), 0)
                        load_s = 0.0
                        self._unspool(item)
                        done += job.tokens
                        computed += job.tokens
                        ctx.on_progress(dtype, done, total)
            finally:
                for item in spool:
                    self._unspool(item)
            t_compute += time.perf_counter() - t_g
            rate = computed / t_compute if t_compute else 0.0
            left = (total - done) / rate if rate and done < total else 0.0
            ctx.on_status(dtype, {"done": done, "total": total, "unit": "tokens", "per_s": rate, "seconds_left": left})
            ctx.emit(
                "batch",
                dtype,
                f"group {g + 1} of {len(plan)} done in turn: {done:,} of {total:,} tokens, {rate:,.0f} tokens/s"
                + (f", {words_left(left)}" if left else "")
                + (f" ({reused} batch(es) were already in the store)" if reused else ""),
            )

    def _vllm_turn(self, lease: Any, vhost: Any, job: Job, load_s: float) -> dict[str, Any]:
        """vLLM scores one batch into the spool (and measures its own noise when the batch holds the
        floor's texts): what HF's turn needs to finish it."""
        from logprob_parity.analysis import floors

        p = self.p
        _, b, lo, hi, n_batches, with_floor, _ = job.inputs()
        texts = p.seqs[lo:hi]
        sample = fullvocab.kept_of(texts, self.sample)
        kept = (job.tokens if sample is None else sample[2]) * 4 * (p.model.vocab_size or 0)
        ex = fullvocab.Exchange(
            job.tokens, p.model.vocab_size, p.device, kind="files", bound=None if sample else self.bound, sample=sample
        )
        item: dict[str, Any] = {"job": job, "ex": ex, "vllm_load_s": load_s, "vllm_info": vhost.info, "bytes": kept}
        with p.ctx.pool.device_turn(p.ctx.waiter(self.dtype), what="scoring"):
            item["vllm"], item["vllm_score_s"] = batch.vllm_side(
                p, self.dtype, self.requests[0], lease, vhost, texts, ex, batch.batch_words(b, n_batches)
            )
            if with_floor:
                others = floors.other_prompts(p.tokenizer, p.spec.bos, self.requests[0].max_model_len, p.device)
                item["vllm_noise"] = lease.call(
                    self.requests[0],
                    lambda: floors.vllm_noise(vhost, texts, [s.logprob for s in item["vllm"]], others, p.device),
                )
        if not ex.why:
            self.spooled += kept
            self.spool_max = max(self.spool_max, self.spooled)
            self.kl_positions += kept // (4 * (p.model.vocab_size or 1))
        return item

    def _hf_turn(self, lease: Any, hhost: Any, item: dict[str, Any], load_s: float) -> tuple[Any, dict[str, Any], Any]:
        p = self.p
        _, b, lo, hi, n_batches, _, digest = item["job"].inputs()
        texts = p.seqs[lo:hi]
        ex = item["ex"]
        described = batch.describe(p, lo, hi)
        scores = {"vllm": item["vllm"]}
        with p.ctx.pool.device_turn(p.ctx.waiter(self.dtype), what="scoring"):
            scores["hf"], hf_s = batch.hf_side(
                p, self.dtype, self.requests[1], lease, hhost, texts, ex, scores["vllm"], batch.batch_words(b, n_batches)
            )
        timing = {
            "vllm_load_s": item["vllm_load_s"],
            "hf_load_s": load_s,
            "vllm_score_s": item["vllm_score_s"],
            "hf_score_s": hf_s,
        }
        info_b = {"engines": {"vllm": item["vllm_info"], "hf": hhost.info}, "timing": timing}
        floor_job = (
            batch.BESIDE.submit(batch.measure_floor, p, self.dtype, self.requests, lease, texts, scores, item["vllm_noise"])
            if "vllm_noise" in item
            else None
        )
        return batch.assemble(
            p, lo, hi, digest, described, scores, info_b, ex.why, {ex.runner} if ex.runner else set(), floor_job
        )

    def _unspool(self, item: dict[str, Any]) -> None:
        ex = item["ex"]
        if not getattr(ex, "_closed", False):
            if not ex.why:
                self.spooled -= item["bytes"]
            ex.close()

    # -- what runs after the parts: the floor past the first batch, and an MoE model's routes --------
    def floor(self, first: list[list[int]], main: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """The floor of a run whose first texts span more than one batch: vLLM's noise in its turn,
        then HF's variations in HF's."""
        from logprob_parity.analysis import floors

        p = self.p
        vreq = self.requests[0]
        t = time.perf_counter()
        with self._lease(0, "the noise floor") as lease:
            vhost = lease.host(vreq)
            others = floors.other_prompts(p.tokenizer, p.spec.bos, vreq.max_model_len, p.device)
            with p.ctx.pool.device_turn(p.ctx.waiter(self.dtype), what="the noise floor"):
                own = lease.call(
                    vreq, lambda: floors.vllm_noise(vhost, first, [s.logprob for s in main["vllm"]], others, p.device)
                )
        with self._lease(1, "the noise floor") as lease:
            floor, _ = batch.measure_floor(p, self.dtype, self.requests, lease, first, main, own)
        return floor, time.perf_counter() - t

    def routing(self, seqs: list[list[int]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """An MoE model's routes: vLLM's were taken in its first turn (`parts`), HF's now (it holds the
        device after the last group); vLLM takes a turn of its own only when a resumed run scored no
        batch with it."""
        p = self.p
        vreq, hreq = self.requests
        with self._lease(1, "the experts each token was routed to") as lease:
            hf = lease.call(hreq, lambda: lease.host(hreq).routes(seqs[: batch.routing_texts(seqs)]))
        if isinstance(hf, str):
            return {"measured": False, "why": hf}, []
        vl = self._vllm_routes
        if vl is None:
            with self._lease(0, "the experts each token was routed to") as lease:
                vl = lease.call(vreq, lambda: lease.host(vreq).routes(seqs[: batch.routing_texts(seqs)]))
        return batch.routes_compared(p, hf, vl, seqs)

    def timing_words(self) -> dict[str, Any]:
        return {
            "engines": "in turn",
            "engines_why": self.fit.words,
            "turns": self.turns,
            "turn_s": round(self.turn_s, 3),
            "spool_bytes_max": self.spool_max,
            "spool_bound_bytes": self.bound,
            **self._turn_seconds(),
            **({"kl_sample": sorted(self.samples), "kl_positions": self.kl_positions} if self.samples else {}),
        }
