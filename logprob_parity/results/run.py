"""A finished comparison for one dtype: data first (frozen, numpy), with table and JSON views."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from logprob_parity.engines.scores import TokenScores
from logprob_parity.errors import TokenMismatchError
from logprob_parity.results.bands import LEVEL_WORDS, bands, noise_limit
from logprob_parity.results.metrics import TokenMetrics, summarize, token_metrics
from logprob_parity.results.records import RunMeta

SCHEMA_VERSION = 1
SIDES = ("hf", "vllm")
LIST_COLUMNS = (
    "hf_topk_ids",
    "hf_topk_logprobs",
    "vllm_topk_ids",
    "vllm_topk_logprobs",
    "hf_at_vllm_topk",
    "hf_topk_text",
    "vllm_topk_text",
)


def table_columns(table: Any) -> dict[str, Any]:
    """A stored run's Arrow table as numpy columns; list columns of one width become [rows, k] arrays."""
    import pyarrow.compute as pc

    n = table.num_rows
    cols: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if name in LIST_COLUMNS:
            flat = pc.list_flatten(col)
            width = len(flat) // n if n else 0
            if width * n != len(flat):
                raise ValueError(f"column {name} has rows of different lengths")
            if name.endswith("_text"):  # each distinct string made once, then indexed
                enc = flat.dictionary_encode() if not hasattr(flat, "dictionary") else flat
                values = (
                    np.asarray(enc.dictionary.to_pylist(), dtype=object)[enc.indices.to_numpy(zero_copy_only=False)]
                    if len(enc)
                    else np.asarray([], dtype=object)
                )
            else:
                values = flat.to_numpy(zero_copy_only=False)
            cols[name] = values.reshape(n, width)
        elif name in ("token", "piece"):
            cols[name] = np.asarray(col.to_pylist(), dtype=object)
        else:
            cols[name] = col.to_numpy(zero_copy_only=False)
    return cols


@dataclass(frozen=True, eq=False)
class SequenceResult:
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    pieces: tuple[str, ...]
    bos_added: bool
    hf: TokenScores
    vllm: TokenScores
    metrics: TokenMetrics
    summary: dict[str, Any]
    # Decoded text of each side's top-k ids, so views need no tokenizer: {"hf": [T][k] strings, ...}
    # (tuples when built, a numpy object array [T, k] when read from the store)
    topk_text: dict[str, Any] | None = None
    # an MoE model's routing against HF's at each token (SequenceInfo.routing); None when not measured
    routing: dict[str, Any] | None = None

    @classmethod
    def build(cls, tok: Any, hf: TokenScores, vllm: TokenScores, decode: Callable[[int], str] | None = None) -> SequenceResult:
        """Compare two sides' scores of the same ids; refuses scores of different ids."""
        ids = np.asarray(tok.token_ids, dtype=np.int64)
        for side, sc in (("hf", hf), ("vllm", vllm)):
            if not np.array_equal(sc.token_ids, ids):
                raise TokenMismatchError(
                    f"{side} scored ids {sc.token_ids.tolist()} but the run has {ids.tolist()}: "
                    "the engines did not score the same tokens, so nothing is compared"
                )
        gathered = hf.gathered_logprobs
        if gathered is None:
            gathered = np.full(vllm.topk_logprobs.shape, np.nan)
        m = token_metrics(
            hf.logprob, vllm.logprob, hf.topk_ids[:, 0], vllm.topk_ids[:, 0], vllm.topk_logprobs, gathered, hf.kl_full
        )
        text = None
        if decode is not None:
            text = {
                side: tuple(tuple(decode(int(i)) if i >= 0 else "" for i in row) for row in sc.topk_ids)
                for side, sc in (("hf", hf), ("vllm", vllm))
            }
        return cls(
            tok.text, tuple(tok.token_ids), tuple(tok.tokens), tuple(tok.pieces), tok.bos_added, hf, vllm, m, summarize(m), text
        )

    def to_frame(self) -> pd.DataFrame:
        n = len(self.token_ids)
        m, hf, vl = self.metrics, self.hf, self.vllm
        gathered = hf.gathered_logprobs if hf.gathered_logprobs is not None else np.full(vl.topk_logprobs.shape, np.nan)
        return pd.DataFrame(
            {
                "index": np.arange(n, dtype=np.int64),
                "token_id": np.asarray(self.token_ids, dtype=np.int64),
                "token": list(self.tokens),
                "piece": list(self.pieces),
                "scored": m.scored,
                "hf_logprob": hf.logprob,
                "vllm_logprob": vl.logprob,
                "hf_rank": hf.rank,
                "vllm_rank": vl.rank,
                "hf_prob": m.hf_prob,
                "vllm_prob": m.vllm_prob,
                "delta": m.delta,
                "abs_delta": m.abs_delta,
                "prob_delta": m.prob_delta,
                "kl_topk": m.kl_topk,
                "kl_full": m.kl_full if m.kl_full is not None else np.full(n, np.nan),
                "argmax_agree": m.argmax_agree,
                "hf_topk_ids": list(hf.topk_ids),
                "hf_topk_logprobs": list(hf.topk_logprobs),
                "vllm_topk_ids": list(vl.topk_ids),
                "vllm_topk_logprobs": list(vl.topk_logprobs),
                "hf_at_vllm_topk": list(gathered),
                "hf_topk_text": [list(r) for r in self.topk_text["hf"]] if self.topk_text else [[]] * n,
                "vllm_topk_text": [list(r) for r in self.topk_text["vllm"]] if self.topk_text else [[]] * n,
            }
        )

    @classmethod
    def from_columns(cls, cols: dict[str, Any], rows: slice, info: Any) -> SequenceResult:
        """One sequence's rows of a stored run, from whole-table columns (see `table_columns`):
        numpy slices, no per-row Python work, so reopening a large run stays fast."""
        ids = cols["token_id"][rows]

        def side(name: str, gathered: np.ndarray | None) -> TokenScores:
            return TokenScores(
                token_ids=ids,
                logprob=cols[f"{name}_logprob"][rows],
                rank=cols[f"{name}_rank"][rows],
                topk_ids=cols[f"{name}_topk_ids"][rows],
                topk_logprobs=cols[f"{name}_topk_logprobs"][rows],
                gathered_logprobs=gathered,
            )

        # runs stored before the exact KL existed have no kl_full column: NaN there
        metrics = TokenMetrics(
            **{f: cols[f][rows] if f in cols else np.full(len(ids), np.nan) for f in TokenMetrics.__dataclass_fields__}
        )
        text = {side: cols[f"{side}_topk_text"][rows] for side in SIDES}
        return cls(
            text=info.text,
            token_ids=tuple(ids.tolist()),
            tokens=tuple(cols["token"][rows]),
            pieces=tuple(cols["piece"][rows]),
            bos_added=bool(info.bos_added),
            hf=side("hf", cols["hf_at_vllm_topk"][rows]),
            vllm=side("vllm", None),
            metrics=metrics,
            summary=info.summary,
            topk_text=text if all(t.shape[1] for t in text.values()) else None,
            routing=getattr(info, "routing", None),
        )

    def positions_json(self) -> list[dict[str, Any]]:
        """The DESIGN.md per-position objects; unscored positions carry nulls."""
        out = []
        m = self.metrics
        for t, tid in enumerate(self.token_ids):
            ok = bool(m.scored[t])
            out.append(
                {
                    "index": t,
                    "token_id": tid,
                    "token": self.tokens[t],
                    "logprob": {s: _num(getattr(self, s).logprob[t]) if ok else None for s in SIDES},
                    "rank": {s: int(getattr(self, s).rank[t]) if ok else None for s in SIDES},
                    "top_k": {s: _topk(getattr(self, s), t) if ok else None for s in SIDES},
                    "delta": _num(m.delta[t]) if ok else None,
                    "abs_delta": _num(m.abs_delta[t]) if ok else None,
                    "prob_delta": _num(m.prob_delta[t]) if ok else None,
                    "kl_topk": _num(m.kl_topk[t]) if ok else None,
                    "kl_full": _num(m.kl_full[t]) if ok and m.kl_full is not None else None,
                    "argmax_agree": bool(m.argmax_agree[t]) if ok else None,
                }
            )
        return out


def _num(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _topk(sc: TokenScores, t: int) -> list[list[Any]]:
    return [[int(i), float(lp)] for i, lp in zip(sc.topk_ids[t], sc.topk_logprobs[t]) if i >= 0]


class StoredSequences(Sequence):
    """A stored run's sequences, read from its Parquet file when first asked for, a few row groups at
    a time: opening one prompt of a 10,000-prompt run reads the row group that holds it, not the run.

    Rows are stored in sequence order, sequence i holding meta.sequences[i].n_positions rows."""

    CACHED_GROUPS = 4
    CACHED_SEQUENCES = 8  # views ask for the same sequence many times a render

    def __init__(self, path: Any, infos: tuple[Any, ...]) -> None:
        import threading

        self._path = path
        self._infos = infos
        self._starts = np.concatenate([[0], np.cumsum([s.n_positions for s in infos])]).astype(np.int64)
        self._file: Any = None
        self._group_starts: np.ndarray | None = None
        self._groups: dict[int, dict[str, Any]] = {}
        self._seqs: dict[int, SequenceResult] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._infos)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        with self._lock:
            if i in self._seqs:
                return self._seqs[i]
        lo, hi = int(self._starts[i]), int(self._starts[i + 1])
        seq = SequenceResult.from_columns(self.rows(lo, hi), slice(0, hi - lo), self._infos[i])
        with self._lock:
            if len(self._seqs) >= self.CACHED_SEQUENCES:
                self._seqs.pop(next(iter(self._seqs)))
            self._seqs[i] = seq
        return seq

    def rows(self, lo: int, hi: int, columns: list[str] | None = None) -> dict[str, Any]:
        """Rows [lo, hi) of the file as numpy columns (see `table_columns`)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        with self._lock:
            if self._file is None:
                self._file = pq.ParquetFile(self._path)
                md = self._file.metadata
                self._group_starts = np.concatenate(
                    [[0], np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)])]
                )
            gs = self._group_starts
            first = int(np.searchsorted(gs, lo, side="right") - 1)
            last = int(np.searchsorted(gs, max(hi - 1, lo), side="right") - 1)
            parts = []
            for g in range(first, last + 1):
                if columns is not None:
                    parts.append(self._file.read_row_group(g, columns=columns))
                    continue
                if g not in self._groups:
                    if len(self._groups) >= self.CACHED_GROUPS:
                        self._groups.pop(next(iter(self._groups)))
                    self._groups[g] = self._file.read_row_group(g)
                parts.append(self._groups[g])
            table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            return table_columns(table.slice(lo - int(gs[first]), hi - lo))


@dataclass(frozen=True)
class RunVerdict:
    """A comparison's verdict as the pages word it: `level` (match, unmeasured, systematic, close,
    differs), `title` ("Match", "Close", ...), `headline` and `reasons`."""

    level: str
    title: str
    headline: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.title}: {self.headline}"


@dataclass(frozen=True, eq=False)
class Run:
    """One model × one dtype × a list of texts. `meta` holds everything but per-position data."""

    meta: RunMeta
    sequences: Sequence[SequenceResult]  # a tuple, or StoredSequences read on demand
    from_store: bool = field(default=False, compare=False)

    @property
    def run_id(self) -> str:
        return self.meta.run_id

    @property
    def dtype(self) -> str:
        return self.meta.dtype

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta.summary

    @property
    def verdict(self) -> RunVerdict | None:
        """The comparison's verdict in the pages' words (level, title, headline, reasons), as stored
        when it ran; None for a run stored before verdicts were (logprob_parity.load makes it then)."""
        v = self.meta.verdict
        if not v:
            return None
        lvl = str(v.get("level", ""))
        return RunVerdict(lvl, LEVEL_WORDS.get(lvl, lvl), str(v.get("headline", "")), tuple(v.get("reasons", ())))

    def __repr__(self) -> str:
        """One line: id, model, dtype, level, mean and largest gap (the dataclass's own repr printed
        every sequence: about 10 KB a run)."""
        s, v = self.summary, self.verdict

        def g(k: str) -> str:
            x = s.get(k)
            return "–" if x is None else f"{x:.3e}"

        level = v.title if v else "no verdict stored"
        return (
            f"Run({self.run_id[:12]} · {self.meta.model} · {self.dtype} · {level} · "
            f"mean |Δ logp| {g('mean_abs_delta')}, largest {g('max_abs_delta')} · {s.get('n_tokens', 0):,} tokens)"
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per position of every sequence, with a `seq` column and each token's `band`, the one
        its colour shows (logprob_parity.results.bands: noise, tolerance, beyond; None where unscored)."""
        if isinstance(self.sequences, StoredSequences):
            import pyarrow.parquet as pq

            df = pq.read_table(self.sequences._path).to_pandas()
        else:
            frames = [s.to_frame().assign(seq=i) for i, s in enumerate(self.sequences)]
            df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
            df = df[["seq"] + [c for c in df.columns if c != "seq"]] if frames else df
        if len(df):
            # object dtype: None where unscored (pandas' str dtype would turn it into NaN, which never equals itself)
            df["band"] = pd.Series(bands(np.where(df["scored"], df["abs_delta"], np.nan), self.noise_limit[0]), dtype=object)
        return df

    @property
    def noise_limit(self) -> tuple[float, str]:
        """Where a token's gap leaves HF's own noise, and whence (logprob_parity.results.bands.noise_limit)."""
        return noise_limit(self.summary, self.dtype)

    def to_pandas(self) -> pd.DataFrame:
        """`to_frame`: one row a position of every sequence (the Python API's name for it)."""
        return self.to_frame()

    def column_frame(self, columns: list[str]) -> pd.DataFrame:
        """These per-position columns (scalars only) of every sequence, with `seq`: a column read of
        the stored file for a large run, never its top-k lists."""
        cols = ["seq"] + [c for c in columns if c != "seq"]
        if isinstance(self.sequences, StoredSequences):
            import pyarrow.parquet as pq

            return pq.read_table(self.sequences._path, columns=cols).to_pandas()
        frames = []
        for i, s in enumerate(self.sequences):
            f = s.to_frame()
            frames.append(f[[c for c in cols if c != "seq"]].assign(seq=i))
        return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)

    def to_json_dict(self) -> dict[str, Any]:
        """The `--json` object of DESIGN.md."""
        return {**self._json_head(), "sequences": [self._sequence_json(s) for s in self.sequences]}

    def write_json(self, f: Any, indent: int | None = 1) -> None:
        """`to_json_dict` written to the text file `f` a sequence at a time (`write_items`), so a
        10,000-prompt run is never one object in memory."""
        write_items(f, self._json_head(), "sequences", (self._sequence_json(s) for s in self.sequences), indent)

    def _sequence_json(self, s: SequenceResult) -> dict[str, Any]:
        positions = s.positions_json()
        for p, b in zip(positions, bands(s.metrics.abs_delta, self.noise_limit[0])):
            p["band"] = b
        return {
            "text": s.text,
            "token_ids": list(s.token_ids),
            "tokens": list(s.tokens),
            "bos_added": s.bos_added,
            "summary": s.summary,
            "positions": positions,
        }

    def _json_head(self) -> dict[str, Any]:
        m = self.meta
        return {
            "run_id": m.run_id,
            "model": m.model,
            "revision": m.revision,
            "dtype": m.dtype,
            "backends": list(m.backends),
            "settings": m.settings,
            "env": m.to_dict()["env"],
            "summary": m.summary,
            "verdict": m.verdict or None,  # set when the comparison is made (analysis.compare)
            "created": m.created or None,
            "top_k": m.top_k,
            "bos": m.bos,
        }


def write_items(f: Any, head: dict[str, Any], key: str, items: Iterable[dict[str, Any]], indent: int | None = 1) -> None:
    """{**head, key: list(items)} as JSON, written to the text file `f` an item at a time: a record's
    many sequences or samples never sit in memory as one object. The head is laid out with `indent`;
    each item is one line of its own (with indent None, the whole is json.dumps' own text). An item
    goes through json's C encoder, which an indent would turn off: a rescore of 100,000 sequences
    writes its --json in a fraction of the time."""
    mark = json.dumps("lpp-items-" + "x" * 12)  # stands where the list goes (the key keeps its place in head)
    text = json.dumps({**head, key: json.loads(mark)}, indent=indent, allow_nan=False)
    cut = text.index(mark)
    f.write(text[:cut] + "[")
    pad = "" if indent is None else "\n" + " " * (2 * indent)
    first = True
    for item in items:
        f.write(("" if first else ", " if indent is None else ",") + pad + json.dumps(item, allow_nan=False))
        first = False
    f.write(("" if indent is None or first else "\n" + " " * indent) + "]" + text[cut + len(mark) :])
