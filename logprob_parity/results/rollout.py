"""What a rollout run is: sampled completions with each token's logprob from three scorings.

A rollout (`logprob_parity/analysis/rollout.py`) samples completions with vLLM's decode path and then
rescores the same ids with vLLM's prefill and with HF, teacher-forced. This module holds the
result as frozen records; the store writes it as Parquet (a row per completion token) with this
metadata as JSON beside it, like a comparison run. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from logprob_parity.results.bands import bands, noise_limit
from logprob_parity.results.records import RunEnv, _pick

ROLLOUT_SCHEMA = 1

# Per completion token, one logprob each:
COLUMNS = (
    "decode_raw",  # vLLM decode, logprobs_mode=raw_logprobs: log_softmax of the model's logits
    "decode_processed",  # vLLM decode, processed_logprobs: after temperature and top-k/top-p
    "prefill",  # vLLM prefill (prompt_logprobs) of prompt+completion
    "hf",  # HF teacher-forced, log_softmax of the logits (float32)
    "hf_tempered",  # HF at the sampling temperature, as an RL trainer rescores
    "log_kept_mass",  # log of the mass top-k/top-p keep at that temperature (HF's full distribution); 0: none cut
)

# Per completion token, beside the logprobs, for the prefill_vs_hf pair (the one pair whose both
# sides have a full distribution; a decode keeps only its sampled token's logprob):
EXACT = (
    "kl_full",  # the exact KL(HF || vLLM prefill) over the whole vocabulary; NaN where not computed
    "same_top",  # 1 where vLLM prefill's and HF's most likely tokens are the same, else 0
)

# name -> (rollout side, trainer side, words). Δ = rollout side − trainer side.
PAIRS: dict[str, tuple[str, str, str]] = {
    "decode_vs_hf": ("decode_raw", "hf", "vLLM decode vs HF (what RL sees)"),
    "decode_vs_prefill": ("decode_raw", "prefill", "vLLM decode vs vLLM prefill (vLLM against itself)"),
    "prefill_vs_hf": ("prefill", "hf", "vLLM prefill vs HF (the Compare page's comparison)"),
    "processed_vs_trainer": (
        "decode_processed",
        "hf_tempered",
        "vLLM's processed logprobs vs HF at the sampling temperature (the trainer's view of a tempered or truncated rollout)",
    ),
}
MAIN_PAIR = "decode_vs_hf"


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled: `samples` per prompt, seeded per sample (seed + its index)."""

    samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    max_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = False

    def validate(self) -> None:
        from logprob_parity.errors import UserError

        if not isinstance(self.samples, int) or not 1 <= self.samples <= 1024:
            raise UserError(f"samples must be a whole number from 1 to 1024 (got {self.samples})")
        if not self.temperature > 0:
            raise UserError(
                f"temperature must be above 0 (got {self.temperature}); a rollout samples, it does not decode greedily"
            )
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1] (got {self.top_p})")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise UserError(f"top-k must be -1 (the whole vocabulary) or a positive whole number (got {self.top_k})")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"max tokens must be a positive whole number (got {self.max_tokens})")

    def processes(self, vocab: int | None) -> bool:
        """Whether vLLM's processed logprobs can differ from its raw ones: temperature, or a cut."""
        cut_k = self.top_k > 0 and (vocab is None or self.top_k < vocab)
        return self.temperature != 1.0 or self.top_p < 1.0 or cut_k

    def seeds(self, n_prompts: int) -> list[int]:
        """One seed per sample, prompt-major: sample j of prompt i is number i * samples + j."""
        return [self.seed + k for k in range(n_prompts * self.samples)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def words(self) -> str:
        k = "all tokens" if self.top_k < 0 else f"top-k {self.top_k}"
        return (
            f"{self.samples} sample(s) a prompt, temperature {self.temperature:g}, top-p {self.top_p:g}, {k}, "
            f"up to {self.max_tokens} tokens, seed {self.seed}"
        )


def sampling_words(sampling: dict[str, Any]) -> str:
    """How a stored rollout's tokens were sampled, in words: by this tool (Sampling.words) or logged
    elsewhere and imported (logprob_parity.analysis.rescore)."""
    if sampling.get("source") == "logged":
        how = (
            "temperatures and cuts vary by record"
            if sampling.get("varies")
            else f"temperature {sampling.get('temperature', 1):g}, top-p {sampling.get('top_p', 1):g}"
            + ("" if sampling.get("top_k", -1) < 0 else f", top-k {sampling['top_k']}")
        )
        return f"{sampling.get('records')} logged sequences from {sampling.get('file')} ({how})"
    names = {f.name for f in dataclasses.fields(Sampling)}
    return Sampling(**{k: v for k, v in sampling.items() if k in names}).words()


@dataclass(frozen=True, eq=False)
class Sample:
    """One sampled completion and each of its tokens' logprobs (arrays over completion tokens)."""

    prompt_index: int
    seed: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    finish_reason: str | None
    logprob: dict[str, np.ndarray]  # COLUMNS -> float64 [n]
    exact: dict[str, np.ndarray] = field(default_factory=dict)  # EXACT -> float64 [n]; empty in rollouts stored before them
    prompt_text: str | None = None  # a logged sequence's prompt, decoded (a sampled one's is meta.prompts[prompt_index])

    def delta(self, pair: str) -> np.ndarray:
        a, b, _ = PAIRS[pair]
        return self.logprob[a] - self.logprob[b]

    def info(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "seed": self.seed,
            "prompt_token_ids": list(self.prompt_token_ids),
            "finish_reason": self.finish_reason,
            "n_tokens": len(self.completion_token_ids),
        }


@dataclass(frozen=True)
class RolloutMeta:
    """Everything about one rollout but its per-token data."""

    rollout_id: str
    created: str
    created_ts: float
    model: str
    model_path: str
    revision: str | None
    model_identity: dict[str, Any]
    dtype: str
    device: str
    bos: str
    settings: dict[str, Any]
    sampling: dict[str, Any]
    prompts: tuple[str, ...]
    processed: str  # how decode_processed was obtained (its own pass, or equal to raw by definition)
    env: RunEnv
    timing: dict[str, Any]
    summary: dict[str, dict[str, Any]]  # pair -> mismatch metrics (logprob_parity.results.offpolicy)
    floors: dict[str, dict[str, Any]]  # noise floor name -> {"mean", "max", "n", "what", ...}
    samples: tuple[dict[str, Any], ...] = ()  # Sample.info() per sample (an MoE model's: with its "routing")
    verdict: dict[str, Any] = field(default_factory=dict)
    # An MoE model: the decode's experts against HF's, and routing replay (logprob_parity.analysis.rollout)
    routing: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompts"] = list(self.prompts)
        d["samples"] = list(self.samples)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutMeta:
        d = _pick(cls, data)
        d["env"] = RunEnv.from_dict(data.get("env", {}))
        d["prompts"] = tuple(d.get("prompts", ()))
        d["samples"] = tuple(d.get("samples", ()))
        return cls(**d)


@dataclass(frozen=True, eq=False)
class Rollout:
    meta: RolloutMeta
    samples: Sequence[Sample]  # a tuple, or StoredSamples (a stored rescore's, read from its file when asked for)
    from_store: bool = False

    @property
    def rollout_id(self) -> str:
        return self.meta.rollout_id

    @property
    def dtype(self) -> str:
        return self.meta.dtype

    def to_pandas(self) -> pd.DataFrame:
        """`to_frame`: one row a completion token (the Python API's name for it)."""
        return self.to_frame()

    def worst_tokens(self, pair: str = "decode_vs_hf", n: int = 20) -> pd.DataFrame:
        """The n tokens whose importance ratio is furthest from 1 for this pair (|Δ logp| largest),
        worst first (ties in sample and position order): sample, position, token, both sides'
        logprobs, Δ and the ratio trainer/rollout. One pass over all tokens a chunk at a time, keeping
        the n best so far (a token without a value, NaN, comes last)."""
        a, b, _ = PAIRS[pair]
        key, where, delta = np.zeros(0), np.zeros((0, 2), dtype=np.int64), np.zeros(0)
        for lo, ns, d in self.delta_chunks(pair):
            if not len(d):
                continue
            k = np.where(np.isnan(d), -1.0, np.abs(d))
            top = np.argsort(-k, kind="stable")[:n]
            starts = np.cumsum(ns) - ns
            i = np.searchsorted(starts, top, side="right") - 1  # the last sample starting at or before: never an empty one
            here = np.stack([lo + i, top - starts[i]], axis=1)
            key, where, delta = np.concatenate([key, k[top]]), np.concatenate([where, here]), np.concatenate([delta, d[top]])
            keep = np.lexsort((where[:, 1], where[:, 0], -key))[:n]  # worst first, ties in sample and position order
            key, where, delta = key[keep], where[keep], delta[keep]
        rows = []
        for (i, t), dv in zip(where.tolist(), delta.tolist()):
            smp = self.samples[i]
            rows.append(
                {
                    "sample": i,
                    "position": t,
                    "token": smp.pieces[t],
                    "token_id": smp.completion_token_ids[t],
                    a: float(smp.logprob[a][t]),
                    b: float(smp.logprob[b][t]),
                    "delta": dv,
                    "ratio": float(np.exp(-dv)),
                }
            )
        return pd.DataFrame(rows)

    def worst_sequences(self, pair: str = "decode_vs_hf", n: int = 20) -> pd.DataFrame:
        """The n sequences whose whole-sequence importance ratio exp(Σ log ρ) is furthest from 1,
        worst first: each sequence's Σ over its tokens with a value, the sequences of one length in a
        chunk summed at once (one pass, however many samples)."""
        if not len(self.samples):
            return pd.DataFrame()
        from logprob_parity.results.offpolicy import by_length

        k = len(self.samples)
        seq_log, largest, counted = np.zeros(k), np.full(k, np.nan), np.zeros(k, dtype=np.int64)
        for lo, ns, dd in self.delta_chunks(pair):
            starts = np.cumsum(ns) - ns
            for length, idx in by_length(ns.tolist()).items():
                d = dd[starts[idx][:, None] + np.arange(length)]  # [sequences of this length, length]
                ok = np.isfinite(d)
                at = np.asarray(idx, dtype=np.int64) + lo
                seq_log[at] = -np.where(ok, d, 0.0).sum(axis=1)
                counted[at] = ok.sum(axis=1)
                largest[at] = np.where(ok.any(axis=1), np.abs(np.where(ok, d, 0.0)).max(axis=1), np.nan)
        order = np.argsort(-np.abs(seq_log), kind="stable")[:n]
        return pd.DataFrame(
            [
                {
                    "sample": int(i),
                    "tokens": int(counted[i]),
                    "seq_log_ratio": float(seq_log[i]),
                    "largest |Δ|": None if np.isnan(largest[i]) else float(largest[i]),
                    "what": self.samples[int(i)].finish_reason or "",
                }
                for i in order.tolist()
            ]
        )

    def prompt_of(self, i: int) -> str:
        """Sample i's prompt text."""
        s = self.samples[i]
        return s.prompt_text if s.prompt_text is not None else self.meta.prompts[s.prompt_index]

    def chunks(self, per: int = 4096, tokens: int = 262_144) -> Iterator[tuple[int, list[Sample]]]:
        """(number of the first, samples) in order, at most `per` samples or about `tokens` tokens a
        chunk: what the store, --json and the lists read at a time, so a stored rescore of 100,000
        long sequences is read a part at a time (logprob_parity.results.rollout.StoredSamples)."""
        part: list[Sample] = []
        lo = used = 0
        for i in range(len(self.samples)):
            smp = self.samples[i]
            part.append(smp)
            used += len(smp.completion_token_ids)
            if len(part) >= per or used >= tokens:
                yield lo, part
                lo, part, used = i + 1, [], 0
        if part:
            yield lo, part

    def delta_chunks(self, pair: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(first sample, token counts of consecutive samples from it, their Δ of `pair` end to end),
        in order: a stored rescore's straight from its file's Δ columns (StoredSamples.column_chunks),
        an in-memory rollout's from its samples (the same float64 differences)."""
        if isinstance(self.samples, StoredSamples):
            yield from self.samples.column_chunks(f"delta_{pair}")
            return
        for lo, part in self.chunks():
            ns = np.array([len(x.completion_token_ids) for x in part], dtype=np.int64)
            yield lo, ns, (np.concatenate([np.asarray(x.delta(pair), dtype=np.float64) for x in part]) if part else np.zeros(0))

    def to_frame(self) -> pd.DataFrame:
        """One row per completion token (what the store writes as Parquet, without each sample's
        prompt and finish columns)."""
        tables = [sample_table(part, range(lo, lo + len(part)), info=False) for lo, part in self.chunks()]
        if not tables:
            return pd.DataFrame(columns=["sample", "prompt", "position", "token_id", "piece", *COLUMNS, "band"])
        import pyarrow as pa

        df = pa.concat_tables(tables).to_pandas()
        a, b, _ = PAIRS[MAIN_PAIR]
        df["band"] = pd.Series(
            bands(np.abs(df[a].to_numpy(np.float64) - df[b].to_numpy(np.float64)), self.noise_limit[0]), dtype=object
        )
        return df

    @property
    def noise_limit(self) -> tuple[float, str]:
        """Where a completion token's gap (MAIN_PAIR) leaves the trainer side's own noise, and whence
        (logprob_parity.results.bands.noise_limit of hf_tail)."""
        return noise_limit(hf_tail(self.meta), getattr(self.meta, "dtype", ""))

    def tables(self, per: int = 4096) -> Iterator[Any]:
        """The stored rows (`sample_table`) a chunk of samples at a time: a rollout of 100,000
        sequences is never one frame."""
        for lo, part in self.chunks(per):
            yield sample_table(part, range(lo, lo + len(part)))

    @classmethod
    def from_frame(cls, meta: RolloutMeta, df: pd.DataFrame, from_store: bool = True) -> Rollout:
        """The stored rows back into samples: sorted once and cut at each sample's bounds (linear in
        the rows, not rows x samples)."""
        order = np.lexsort((df["position"].to_numpy(), df["sample"].to_numpy()))
        sample = df["sample"].to_numpy()[order]
        ids = df["token_id"].to_numpy()[order]
        pieces = df["piece"].to_numpy(dtype=object)[order]
        values = {c: df[c].to_numpy(dtype=np.float64)[order] for c in (*COLUMNS, *EXACT) if c in df}
        bounds = np.searchsorted(sample, np.arange(len(meta.samples) + 1))
        samples = []
        for i, info in enumerate(meta.samples):
            a, b = int(bounds[i]), int(bounds[i + 1])
            samples.append(
                Sample(
                    prompt_index=int(info["prompt_index"]),
                    seed=int(info["seed"]),
                    prompt_token_ids=tuple(int(x) for x in info["prompt_token_ids"]),
                    completion_token_ids=tuple(ids[a:b].tolist()),
                    pieces=tuple(str(x) for x in pieces[a:b]),
                    finish_reason=info.get("finish_reason"),
                    logprob={c: values[c][a:b] for c in COLUMNS},
                    exact={c: values[c][a:b] for c in EXACT if c in values},
                )
            )
        return cls(meta=meta, samples=tuple(samples), from_store=from_store)

    def to_json_dict(self) -> dict[str, Any]:
        """The `--json` shape: per sample its ids and, per completion position, every logprob and Δ."""
        return {**self.meta.to_dict(), "samples": list(self._samples_json())}

    def write_json(self, f: Any, indent: int | None = 1) -> None:
        """`to_json_dict` written to the text file `f` a sample at a time (logprob_parity.results.run.write_items),
        so a rescore of many logged sequences is never one object in memory."""
        from logprob_parity.results.run import write_items

        write_items(f, self.meta.to_dict(), "samples", self._samples_json(), indent)

    def _samples_json(self, per: int = 4096) -> Iterator[dict[str, Any]]:
        """Each sample's --json object; the metrics of `per` samples at a time, each pair in one call."""
        from logprob_parity.results.offpolicy import mismatch_metrics_each

        for _, part in self.chunks(per):
            each = {
                pair: mismatch_metrics_each([s.logprob[a] for s in part], [s.logprob[b] for s in part])
                for pair, (a, b, _) in PAIRS.items()
            }
            exact = exact_stats_each(part)
            for j, s in enumerate(part):
                metrics = {pair: each[pair][j] for pair in PAIRS}
                metrics["prefill_vs_hf"].update(exact[j])
                yield _sample_json(s, metrics, self.noise_limit[0])


class StoredSamples(Sequence):
    """A stored rescore's samples, read from its Parquet file a row group at a time when asked for:
    the file holds each sample's rows in sample order, its prompt and finish on its first row
    (INFO_COLUMNS), so nothing a sample needs is kept in the metadata; opening one of 100,000
    sequences reads the row group that holds it. Row groups are found by their `sample` range."""

    CACHED_GROUPS = 4

    def __init__(self, path: Any, n: int) -> None:
        self._path, self._n = path, n
        self._file: Any = None
        self._ranges = np.zeros((0, 2), dtype=np.int64)
        self._groups: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        with self._lock:
            parts = [self._group(g) for g in self._groups_of(i)]
        if not parts:  # a sample without completion tokens has no rows
            return Sample(
                prompt_index=i,
                seed=-1,
                prompt_token_ids=(),
                completion_token_ids=(),
                pieces=(),
                finish_reason=None,
                logprob={c: np.zeros(0) for c in COLUMNS},
                exact={c: np.zeros(0) for c in EXACT},
            )
        cols: dict[str, Any] = {}
        info: dict[str, Any] = {}
        for g in parts:
            a, b = np.searchsorted(g["sample"], [i, i + 1])
            for c, v in g.items():
                if c != "info":
                    cols.setdefault(c, []).append(v[a:b])
            info = g["info"].get(i, info)
        col = {c: np.concatenate(v) if len(v) > 1 else v[0] for c, v in cols.items()}
        return Sample(
            prompt_index=int(col["prompt"][0]) if len(col["prompt"]) else i,
            seed=int(info.get("seed") or -1),
            prompt_token_ids=tuple(info.get("prompt_token_ids") or ()),
            completion_token_ids=tuple(col["token_id"].tolist()),
            pieces=tuple(col["piece"].tolist()),
            finish_reason=info.get("finish_reason"),
            logprob={c: col[c] for c in COLUMNS},
            exact={c: col[c] for c in EXACT},
            prompt_text=info.get("prompt_text"),
        )

    def column_chunks(self, column: str) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(first sample, token counts of the consecutive samples from it, their `column` end to end),
        a row group at a time, read straight from the file (no Sample is built): what a pass over
        every token (the worst lists, the histograms) reads. A sample cut by a row group's end is
        carried into the next chunk."""
        import pyarrow.parquet as pq

        file = pq.ParquetFile(self._path)  # its own reader: another thread may be reading a sample through self._file
        groups = file.metadata.num_row_groups
        done = 0
        carry_s, carry_v = np.zeros(0, dtype=np.int64), np.zeros(0)
        for g in range(groups):
            t = file.read_row_group(g, columns=["sample", column])
            smp = np.concatenate([carry_s, t.column("sample").to_numpy()])
            val = np.concatenate([carry_v, t.column(column).to_numpy()])
            hi = int(smp.max()) if g < groups - 1 and len(smp) else self._n
            cut = int(np.searchsorted(smp, hi)) if g < groups - 1 else len(smp)
            carry_s, carry_v = smp[cut:], val[cut:]
            if hi > done:
                yield done, np.bincount(smp[:cut] - done, minlength=hi - done), val[:cut]
                done = hi
        if done < self._n:
            yield done, np.zeros(self._n - done, dtype=np.int64), np.zeros(0)

    def _groups_of(self, i: int) -> list[int]:
        if self._file is None:
            import pyarrow.parquet as pq

            self._file = pq.ParquetFile(self._path)
            md = self._file.metadata
            at = self._file.schema_arrow.get_field_index("sample")
            ranges = []
            for g in range(md.num_row_groups):
                st = md.row_group(g).column(at).statistics
                if st is None or not st.has_min_max:
                    sample = self._file.read_row_group(g, columns=["sample"]).column(0).to_numpy()
                    ranges.append((int(sample.min()), int(sample.max())) if len(sample) else (-1, -2))
                else:
                    ranges.append((int(st.min), int(st.max)))
            self._ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        r = self._ranges
        return np.flatnonzero((r[:, 0] <= i) & (i <= r[:, 1])).tolist()

    def _group(self, g: int) -> dict[str, Any]:
        if g not in self._groups:
            import pyarrow.compute as pc

            t = self._file.read_row_group(g)
            cols: dict[str, Any] = {c: t.column(c).to_numpy() for c in ("sample", "prompt", "token_id", *COLUMNS, *EXACT)}
            cols["piece"] = np.asarray(t.column("piece").to_pylist(), dtype=object)
            firsts = t.filter(pc.equal(t.column("position"), 0)).select(["sample", *INFO_COLUMNS]).to_pylist()
            cols["info"] = {r.pop("sample"): r for r in firsts}
            if len(self._groups) >= self.CACHED_GROUPS:
                self._groups.pop(next(iter(self._groups)))
            self._groups[g] = cols
        return self._groups[g]


INFO_COLUMNS = ("prompt_token_ids", "prompt_text", "finish_reason", "seed")  # a sample's own, on its position-0 row


def sample_table(samples: list[Sample], numbers: Any, info: bool = True) -> Any:
    """These samples' rows, one a completion token, as an Arrow table built column by column:
    sample number (`numbers`, one a sample), prompt, position, token id and text, COLUMNS, EXACT and
    each pair's Δ; with `info`, INFO_COLUMNS on each sample's first row (null on the others), which
    is all a stored rescore keeps of its samples (StoredSamples reads them back)."""
    import pyarrow as pa

    ns = np.array([len(x.completion_token_ids) for x in samples], dtype=np.int64)
    total = int(ns.sum())
    cat = lambda arrays: np.concatenate(arrays) if arrays else np.zeros(0)  # noqa: E731
    position = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(ns) - ns, ns)
    cols: dict[str, Any] = {
        "sample": np.repeat(np.asarray(list(numbers), dtype=np.int64), ns),
        "prompt": np.repeat(np.array([x.prompt_index for x in samples], dtype=np.int64), ns),
        "position": position,
        "token_id": np.fromiter((t for x in samples for t in x.completion_token_ids), dtype=np.int64, count=total),
        "piece": pa.array([piece for x in samples for piece in x.pieces], pa.string()),
        **{c: cat([np.asarray(x.logprob[c], dtype=np.float64) for x in samples]) for c in COLUMNS},
        **{
            c: cat([np.asarray(x.exact.get(c, np.full(len(x.completion_token_ids), np.nan)), dtype=np.float64) for x in samples])
            for c in EXACT
        },
        **{f"delta_{pair}": cat([np.asarray(x.delta(pair), dtype=np.float64) for x in samples]) for pair in PAIRS},
    }
    if info:
        first = np.cumsum(ns) - ns
        at = {int(f): x for f, x, n in zip(first, samples, ns) if n}

        def spread(get: Any, kind: Any) -> Any:
            return pa.array(_sparse(total, {r: get(x) for r, x in at.items()}), kind)

        cols["prompt_token_ids"] = spread(lambda x: list(x.prompt_token_ids), pa.list_(pa.int64()))
        cols["prompt_text"] = spread(lambda x: x.prompt_text, pa.string())
        cols["finish_reason"] = spread(lambda x: x.finish_reason, pa.string())
        cols["seed"] = spread(lambda x: x.seed, pa.int64())
    return pa.table(cols)


def _sparse(total: int, at: dict[int, Any]) -> list[Any]:
    out: list[Any] = [None] * total
    for r, v in at.items():
        out[r] = v
    return out


def _sample_json(s: Sample, metrics: dict[str, Any], limit: float) -> dict[str, Any]:
    """One sample's --json object: its ids, its metrics, and per completion position every value and
    its band against the noise `limit` (logprob_parity.results.bands)."""
    n = len(s.completion_token_ids)
    band = bands(np.abs(s.delta(MAIN_PAIR)), limit)
    lp = {c: _nums(s.logprob[c]) for c in COLUMNS}
    delta = {pair: _nums(s.delta(pair)) for pair in PAIRS}
    exact = {c: _nums(s.exact[c]) if c in s.exact else [None] * n for c in EXACT}
    positions = [
        {
            "position": t,
            "token_id": s.completion_token_ids[t],
            "piece": s.pieces[t],
            "logprob": {k: lp[k][t] for k in ("decode_raw", "decode_processed", "prefill", "hf")},
            "hf_tempered": lp["hf_tempered"][t],
            "log_kept_mass": lp["log_kept_mass"][t],
            "delta": {pair: delta[pair][t] for pair in PAIRS},
            "prefill_vs_hf": {c: exact[c][t] for c in EXACT},
            "band": band[t],
        }
        for t in range(n)
    ]
    return {**s.info(), "completion_token_ids": list(s.completion_token_ids), "metrics": metrics, "positions": positions}


def _nums(a: Any) -> list[float | None]:
    """An array as JSON numbers: floats, None where not finite (JSON has no NaN)."""
    return [x if math.isfinite(x) else None for x in np.asarray(a, dtype=np.float64).tolist()]


def exact_stats(samples: Any, sampled: bool = False) -> dict[str, float | None]:
    """llama.cpp's exact-KL and same-top statistics of the prefill_vs_hf pair over these samples'
    completion tokens (logprob_parity.results.metrics); None where a sample lacks them. sampled: the
    exact KL exists on a sample of positions only (engines in turn), and its statistics are of those."""
    from logprob_parity.results.metrics import exact_kl_stats, same_top_stats

    have = all(c in s.exact for s in samples for c in EXACT)
    kl = np.concatenate([s.exact["kl_full"] for s in samples]) if have and samples else np.array([np.nan])
    if sampled:
        kl = kl[np.isfinite(kl)]
    same = np.concatenate([s.exact["same_top"] for s in samples]) if have and samples else np.array([])
    return {**exact_kl_stats(kl), **same_top_stats(same[np.isfinite(same)] > 0.5 if np.isfinite(same).all() else np.array([]))}


def exact_stats_each(samples: Any) -> list[dict[str, float | None]]:
    """[exact_stats([s]) for s in samples], computed for all samples of one length at once (a
    rescore's --json gives each of 100,000 sequences its own)."""
    from logprob_parity.results.metrics import exact_kl_stats_rows, same_top_stats_rows
    from logprob_parity.results.offpolicy import by_length

    have = [all(c in s.exact for c in EXACT) for s in samples]
    out: list[dict[str, float | None]] = [{} if h and s.completion_token_ids else exact_stats([s]) for s, h in zip(samples, have)]
    for idx in by_length(len(s.completion_token_ids) if h else 0 for s, h in zip(samples, have)).values():
        kl = np.stack([np.asarray(samples[i].exact["kl_full"], dtype=np.float64) for i in idx])
        same = np.stack([np.asarray(samples[i].exact["same_top"], dtype=np.float64) for i in idx])
        finite = np.isfinite(same).all(axis=1)
        tops = same_top_stats_rows(same > 0.5)
        empty = same_top_stats_rows(np.zeros((1, 0), dtype=bool))[0]
        for i, k, t, f in zip(idx, exact_kl_stats_rows(kl), tops, finite.tolist()):
            out[i] = {**k, **(t if f else empty)}
    return out


def hf_floor(meta: RolloutMeta) -> float | None:
    """The trainer side's own noise floor: the largest mean of the floor's variations
    (logprob_parity.analysis.floors); rollouts stored before that definition: of HF's floors."""
    return _hf_floor(meta)[0]


def hf_floor_words(meta: RolloutMeta) -> str | None:
    """The variation that set the trainer side's floor, in words."""
    return _hf_floor(meta)[1]


def hf_tail(meta: RolloutMeta) -> dict[str, Any]:
    """The trainer side's noise tail and argmax flips, as a floor's keys (logprob_parity.analysis.floors.tail_of):
    from the floor's variations, each of which carries its own tail; rollouts stored before the tail: its
    largest value (hf_noise_max)."""
    return floors_tail(getattr(meta, "floors", None) or {})


def floors_tail(floors: dict[str, Any]) -> dict[str, Any]:
    """hf_tail of a rollout's floor rows."""
    rows = {
        k: f
        for k, f in floors.items()
        if f.get("side") == "hf" and (f.get("in_floor") or k == "envelope") and f.get("mean") is not None
    }
    if not rows:
        return {}
    from logprob_parity.results.bands import tail_of

    out = tail_of(rows)
    return {**out, "hf_noise_max": max(f["max"] for f in rows.values() if f.get("max") is not None)}


def with_bands(summary: dict[str, Any], floors: dict[str, Any], dtype: str, chunks: Any) -> dict[str, Any]:
    """The summary with its main pair's band counts (logprob_parity.results.bands) against the floor's
    tail: chunks of (decode_raw, hf) logprobs, the pair the token view colours."""
    from logprob_parity.results.bands import noise_limit, pair_band_stats

    limit, source = noise_limit(floors_tail(floors), dtype)
    return {**summary, MAIN_PAIR: {**summary[MAIN_PAIR], **pair_band_stats(chunks, limit, source)}}


def _hf_floor(meta: RolloutMeta) -> tuple[float | None, str | None]:
    hf = {k: f for k, f in meta.floors.items() if f.get("side") == "hf" and f.get("mean") is not None}
    defined = {k: f for k, f in hf.items() if f.get("in_floor")}
    got = defined or hf
    if not got:
        return None, None
    key = max(got, key=lambda k: got[k]["mean"])
    f = got[key]
    return f["mean"], f.get("words") or f.get("what")
