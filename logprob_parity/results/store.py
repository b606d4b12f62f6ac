"""Runs on disk: one Parquet file per run (positions + metadata) and a SQLite index.

Writes are atomic (temp file, fsync, rename; the index row last), so a half-written run is never
read as complete. Nothing here unpickles: Parquet and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import time
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from logprob_parity.errors import UserError
from logprob_parity.paths import store_root
from logprob_parity.results.records import DiagnosticsResult, RunMeta
from logprob_parity.results.run import SCHEMA_VERSION, Run, StoredSequences

META_KEY = b"logprob_parity_meta"
REQUIRED_COLUMNS = {
    "seq",
    "index",
    "token_id",
    "token",
    "piece",
    "scored",
    "hf_logprob",
    "vllm_logprob",
    "hf_rank",
    "vllm_rank",
    "hf_prob",
    "vllm_prob",
    "delta",
    "abs_delta",
    "prob_delta",
    "kl_topk",
    "argmax_agree",
    "hf_topk_ids",
    "hf_topk_logprobs",
    "vllm_topk_ids",
    "vllm_topk_logprobs",
    "hf_at_vllm_topk",
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    dtype TEXT NOT NULL,
    n_sequences INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    max_abs_delta REAL,
    mean_abs_delta REAL,
    meta TEXT NOT NULL,
    sha256 TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (request_key TEXT PRIMARY KEY, run_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS diagnostics (
    diagnostics_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    dtypes TEXT NOT NULL,
    parts TEXT NOT NULL,
    run_ids TEXT NOT NULL,
    first_text TEXT NOT NULL,
    sha256 TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS frontiers (
    frontier_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    n_configs INTEGER NOT NULL,
    recommendation TEXT,
    first_text TEXT NOT NULL,
    sha256 TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    dtype TEXT NOT NULL,
    n_samples INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    max_abs_delta REAL,
    mean_abs_delta REAL,
    meta TEXT NOT NULL,
    sha256 TEXT NOT NULL
);
"""
ROW_GROUP = 65536  # positions per Parquet row group of a run: the unit a view reads


def dictionary_columns(schema: Any) -> list[str]:
    """The Parquet column paths worth a dictionary: the strings (token names, pieces, top-k texts),
    which repeat. Numbers are written plain: a dictionary of nearly unique floats cost 0.23 s of a
    64 x 512-token run's 0.28 s write (2-core CPU) and made the file larger (10.1 MB, against 9.1 MB
    with dictionaries on the strings alone)."""
    import pyarrow as pa

    out = []
    for field in schema:
        t = field.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            out.append(field.name)
        elif (pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)) and (
            pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
        ):
            out.append(f"{field.name}.list.element")
    return out


def parquet_writer(f: Any, schema: Any) -> Any:
    """A Parquet writer for a run or a rollout: dictionaries on the string columns only."""
    import pyarrow.parquet as pq

    return pq.ParquetWriter(f, schema, use_dictionary=dictionary_columns(schema))


ROLLOUT_COLUMNS = {
    "sample",
    "prompt",
    "position",
    "token_id",
    "piece",
    "decode_raw",
    "decode_processed",
    "prefill",
    "hf",
    "hf_tempered",
    "log_kept_mass",
}


class Store:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else store_root()
        self.runs_dir = self.root / "runs"
        self._legacy_indexed = False
        try:
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            with closing(self._db()) as db, db:
                db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(
                f"store folder {self.root} is not usable ({exc}); set LOGPROB_PARITY_HOME to a writable folder"
            ) from exc

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.root / "index.sqlite", timeout=30)

    def path_of(self, run_id: str) -> Path:
        return self.runs_dir / f"{run_id}.parquet"

    # -- write ---------------------------------------------------------------------------------
    def save(self, run: Run, request_key: str | None = None) -> None:
        """An in-memory run (its table built through pandas); comparisons write theirs with
        `write_run`, straight from the engines' arrays."""
        import pyarrow as pa

        self.write_run(run.meta, [pa.Table.from_pandas(run.to_frame(), preserve_index=False)], request_key)

    def write_run(self, meta: RunMeta, tables: Any, request_key: str | None = None) -> None:
        """One run from its position tables (a list, or an iterator read one at a time: a run of
        many batches is never held whole), with `meta` in the file; row groups of at most
        ROW_GROUP rows, so one prompt of a large run is read without the rest."""
        meta_d = dict(meta.to_dict(), schema_version=SCHEMA_VERSION)
        blob = json.dumps(meta_d, allow_nan=False)

        def write(f: Any) -> None:
            writer = None
            try:
                for table in tables:
                    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: blob})
                    if writer is None:
                        writer = parquet_writer(f, table.schema)
                    elif table.schema != writer.schema:
                        table = table.cast(writer.schema)
                    writer.write_table(table, row_group_size=ROW_GROUP)
            except BaseException:
                if writer is not None:
                    with suppress(Exception):  # the half-written temp file is removed by _atomic_write
                        writer.close()
                raise
            if writer is not None:
                writer.close()

        digest = _atomic_write(self.path_of(meta.run_id), write)
        self._index_run(meta, meta_d, digest, request_key)

    def _index_run(self, meta: RunMeta, meta_d: dict[str, Any], digest: str, request_key: str | None) -> None:
        """The index row: the run's metadata without its per-sequence list (a 10,000-prompt run's
        would be megabytes, read on every listing), plus what the Runs page shows of it."""
        light = {k: v for k, v in meta_d.items() if k != "sequences"}
        light["first_text"] = _first_text(meta_d)
        light["comparison"] = _comparison_key(meta_d)
        s = meta.summary
        with closing(self._db()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    meta.run_id,
                    meta_d.get("created_ts") or time.time(),
                    meta.model,
                    meta.dtype,
                    len(meta.sequences),
                    s["n_tokens"],
                    s["max_abs_delta"],
                    s["mean_abs_delta"],
                    json.dumps(light, allow_nan=False),
                    digest,
                ),
            )
            if request_key:
                db.execute("INSERT OR REPLACE INTO requests VALUES (?,?)", (request_key, meta.run_id))

    # -- batches of a run in progress -----------------------------------------------------------
    def partial_dir(self, run_id: str) -> Path:
        """Where a run's finished batches wait for the rest: a killed run restarted with the same
        request finds them here and computes only what is missing."""
        return self.root / "partial" / run_id

    def save_part(self, run_id: str, number: int, table: Any, info: dict[str, Any]) -> None:
        """One finished batch: its table (Arrow IPC, read back column by column) with `info` (JSON:
        its sequences, ids digest, engines and timing) inside, written atomically."""
        import pyarrow as pa

        folder = self.partial_dir(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        table = table.replace_schema_metadata({META_KEY: json.dumps(info, allow_nan=False)})

        def write(f: Any) -> None:
            with pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)

        _atomic_write(folder / f"part-{number:06d}.arrow", write)

    def part_info(self, run_id: str, number: int) -> dict[str, Any] | None:
        """A stored batch's info, or None when it is missing or unreadable (then it is recomputed)."""
        import pyarrow as pa

        path = self.partial_dir(run_id) / f"part-{number:06d}.arrow"
        if not path.is_file():
            return None
        try:
            with pa.memory_map(str(path)) as src:
                return json.loads(pa.ipc.open_file(src).schema.metadata[META_KEY])
        except (OSError, KeyError, ValueError, pa.ArrowInvalid):
            return None

    def part_table(self, run_id: str, number: int, columns: list[str] | None = None) -> Any:
        import pyarrow as pa

        path = self.partial_dir(run_id) / f"part-{number:06d}.arrow"
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        table = table.select(columns) if columns else table
        return table.replace_schema_metadata(None)

    def new_staged(self) -> Path:
        """A path for this process's staged copy of a logged file (logprob_parity.inputs.rollout_logs.stage_logged),
        in `partial/logged/`; staged files left by processes that are gone (killed) are removed first
        (`spool-*` is what older versions named them; "spool" now means what vLLM leaves for HF in turn)."""
        folder = self.root / "partial" / "logged"
        folder.mkdir(parents=True, exist_ok=True)
        for old in [*folder.glob("staged-*.arrow"), *folder.glob("spool-*.arrow")]:
            try:
                os.kill(int(old.stem.split("-")[1]), 0)
            except (ValueError, IndexError, ProcessLookupError):
                old.unlink(missing_ok=True)
            except PermissionError:
                pass
        return folder / f"staged-{os.getpid()}-{time.monotonic_ns()}.arrow"

    def drop_partial(self, run_id: str) -> None:
        import shutil

        shutil.rmtree(self.partial_dir(run_id), ignore_errors=True)

    def delete(self, run_id: str) -> None:
        run_id = self.resolve_id(run_id)
        with closing(self._db()) as db, db:
            db.execute("DELETE FROM runs WHERE run_id=?", (run_id,))
            db.execute("DELETE FROM requests WHERE run_id=?", (run_id,))
        self.path_of(run_id).unlink(missing_ok=True)

    # -- read ----------------------------------------------------------------------------------
    def lookup_request(self, request_key: str) -> str | None:
        with closing(self._db()) as db:
            row = db.execute(
                "SELECT r.run_id FROM requests q JOIN runs r ON r.run_id = q.run_id WHERE q.request_key=?",
                (request_key,),
            ).fetchone()
        if row and self.path_of(row[0]).is_file():
            return row[0]
        return None

    def has(self, run_id: str) -> bool:
        with closing(self._db()) as db:
            row = db.execute("SELECT 1 FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row is not None and self.path_of(run_id).is_file()

    def _by_prefix(self, table: str, column: str, prefix: str, what: str, plural: str, extra: str = "") -> tuple:
        """The one index row whose id starts with `prefix` (a full id or a unique prefix of one)."""
        if not prefix or not all(c in "0123456789abcdef" for c in prefix):
            raise UserError(f"{prefix!r} is not a {what} id (hex digits)")
        with closing(self._db()) as db:
            rows = db.execute(
                f"SELECT {column}{extra} FROM {table} WHERE {column} LIKE ?",  # noqa: S608 - names are ours
                (prefix + "%",),
            ).fetchall()
        if not rows:
            raise UserError(f"no stored {what} with id {prefix!r} (see `logprob-parity runs`)")
        if len(rows) > 1:
            raise UserError(f"{what} id prefix {prefix!r} is ambiguous ({len(rows)} {plural})")
        return rows[0]

    def resolve_id(self, run_id: str) -> str:
        """A full id or a unique prefix of one."""
        return self._by_prefix("runs", "run_id", run_id, "run", "runs")[0]

    def load(self, run_id: str) -> Run:
        import pyarrow.parquet as pq

        run_id = self.resolve_id(run_id)
        path = self.path_of(run_id)
        if not path.is_file():
            raise UserError(f"no stored run {run_id}: its file is missing from {self.runs_dir}")
        with closing(self._db()) as db:
            (expected,) = db.execute("SELECT sha256 FROM runs WHERE run_id=?", (run_id,)).fetchone()
        try:
            if _sha256(path) != expected:
                raise UserError(f"stored run {run_id} failed its integrity check (file changed since it was written)")
            schema = pq.read_schema(path)
            raw = json.loads(schema.metadata[META_KEY])
            rows = pq.ParquetFile(path).metadata.num_rows
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise UserError(f"stored run {run_id} is unreadable ({type(exc).__name__}: {exc})") from exc
        if raw.get("run_id") != run_id or raw.get("schema_version") != SCHEMA_VERSION:
            raise UserError(f"stored run {run_id} does not match its index entry (schema or id); delete and re-run it")
        missing = REQUIRED_COLUMNS - set(schema.names)
        if missing:
            raise UserError(f"stored run {run_id} lacks columns {sorted(missing)}; delete and re-run it")
        meta = RunMeta.from_dict(raw)
        if any(s.n_positions == 0 for s in meta.sequences):  # runs stored before sequences had their length
            import dataclasses

            counts = np.bincount(pq.read_table(path, columns=["seq"]).column("seq").to_numpy(), minlength=len(meta.sequences))
            meta = dataclasses.replace(
                meta, sequences=tuple(dataclasses.replace(s, n_positions=int(c)) for s, c in zip(meta.sequences, counts))
            )
        if sum(s.n_positions for s in meta.sequences) != rows:
            raise UserError(
                f"stored run {run_id} holds {rows} positions but its sequences list "
                f"{sum(s.n_positions for s in meta.sequences)}; delete and re-run it"
            )
        # sequences are read when first shown, a few row groups at a time (logprob_parity.results.run.StoredSequences)
        return Run(meta=meta, sequences=StoredSequences(path, meta.sequences), from_store=True)

    # -- diagnostics -----------------------------------------------------------------------------
    @property
    def diagnostics_dir(self) -> Path:
        return self.root / "diagnostics"

    def save_diagnostics(self, result: DiagnosticsResult) -> None:
        """JSON (never pickle), written like a run: temp file, fsync, rename, then the index row
        with the file's checksum."""
        folder = self.diagnostics_dir
        folder.mkdir(exist_ok=True)
        data = json.dumps(result.to_dict(), allow_nan=False).encode("utf-8")
        digest = _atomic_write(folder / f"{result.diagnostics_id}.json", lambda f: f.write(data))
        self._index_diagnostics(result, digest)

    def _index_diagnostics(self, result: DiagnosticsResult, digest: str) -> None:
        with closing(self._db()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO diagnostics VALUES (?,?,?,?,?,?,?,?)",
                (
                    result.diagnostics_id,
                    result.created_ts or time.time(),
                    result.model,
                    ",".join(result.dtypes),
                    ",".join(result.parts),
                    json.dumps(result.run_ids),
                    (result.texts[0] if result.texts else "")[:80],
                    digest,
                ),
            )

    def _index_legacy_diagnostics(self) -> None:
        """Diagnostics written by earlier versions sit in the folder without an index row: index them,
        once per Store (later ones are indexed as they are saved)."""
        folder = self.diagnostics_dir
        if self._legacy_indexed or not folder.is_dir():
            return
        self._legacy_indexed = True
        with closing(self._db()) as db:
            known = {r[0] for r in db.execute("SELECT diagnostics_id FROM diagnostics")}
        for path in folder.glob("*.json"):
            if path.stem in known:
                continue
            try:
                result = DiagnosticsResult.from_dict(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if result.diagnostics_id == path.stem:
                if not result.created_ts:
                    import dataclasses

                    result = dataclasses.replace(result, created_ts=path.stat().st_mtime)
                self._index_diagnostics(result, _sha256(path))

    def load_diagnostics(self, diag_id: str) -> DiagnosticsResult:
        self._index_legacy_diagnostics()
        full, expected = self._by_prefix("diagnostics", "diagnostics_id", diag_id, "diagnostics", "results", ", sha256")
        return DiagnosticsResult.from_dict(
            _checked_json(self.diagnostics_dir / f"{full}.json", expected, f"stored diagnostics {full}")
        )

    def list_diagnostics(self) -> pd.DataFrame:
        self._index_legacy_diagnostics()
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT diagnostics_id, created, model, dtypes, parts, first_text, run_ids FROM diagnostics ORDER BY created DESC"
            ).fetchall()
        df = pd.DataFrame(rows, columns=["diagnostics_id", "created", "model", "dtypes", "parts", "first_text", "run_ids"])
        df["created"] = pd.to_datetime(df["created"], unit="s", utc=True)
        return df

    def diagnostics_for_run(self, run_id: str) -> DiagnosticsResult | None:
        """The newest diagnostics built on this run, if any."""
        for row in self.list_diagnostics().itertuples():
            if run_id in json.loads(row.run_ids).values():
                try:
                    return self.load_diagnostics(row.diagnostics_id)
                except UserError:
                    continue
        return None

    def delete_diagnostics(self, diag_id: str) -> None:
        with closing(self._db()) as db, db:
            db.execute("DELETE FROM diagnostics WHERE diagnostics_id=?", (diag_id,))
        (self.diagnostics_dir / f"{diag_id}.json").unlink(missing_ok=True)

    # -- frontiers -------------------------------------------------------------------------------
    def save_frontier(self, result: Any) -> None:
        """JSON (never pickle), written like a run: temp file, fsync, rename, then the index row."""
        folder = self.root / "frontiers"
        folder.mkdir(exist_ok=True)
        data = json.dumps(result.to_dict(), allow_nan=False).encode("utf-8")
        digest = _atomic_write(folder / f"{result.frontier_id}.json", lambda f: f.write(data))
        with closing(self._db()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO frontiers VALUES (?,?,?,?,?,?,?)",
                (
                    result.frontier_id,
                    result.created_ts or time.time(),
                    result.model,
                    len(result.configs),
                    result.recommendation.get("name"),
                    (result.texts[0] if result.texts else "")[:80],
                    digest,
                ),
            )

    def resolve_frontier_id(self, prefix: str) -> str:
        return self._by_prefix("frontiers", "frontier_id", prefix, "frontier", "frontiers")[0]

    def load_frontier(self, frontier_id: str) -> Any:
        from logprob_parity.results.frontier import FrontierResult

        full, expected = self._by_prefix("frontiers", "frontier_id", frontier_id, "frontier", "frontiers", ", sha256")
        return FrontierResult.from_dict(
            _checked_json(self.root / "frontiers" / f"{full}.json", expected, f"stored frontier {full}")
        )

    def list_frontiers(self) -> pd.DataFrame:
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT frontier_id, created, model, n_configs, recommendation, first_text FROM frontiers ORDER BY created DESC"
            ).fetchall()
        df = pd.DataFrame(rows, columns=["frontier_id", "created", "model", "n_configs", "recommendation", "first_text"])
        df["created"] = pd.to_datetime(df["created"], unit="s", utc=True)
        return df

    # -- rollouts ------------------------------------------------------------------------------
    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    def save_rollout(self, ro: Any) -> None:
        """A rollout as Parquet (a row per completion token, a few thousand samples written at a
        time: never the whole rollout as one frame) with its metadata as JSON in the file."""
        self.write_rollout(ro.meta, ro.tables(), len(ro.samples))

    def write_rollout(self, meta_obj: Any, tables: Any, n_samples: int) -> None:
        """A rollout from its row tables (logprob_parity.results.rollout.sample_table; an iterator is read one
        at a time), written like a run: temp file, fsync, rename, then the index row with the
        checksum. The index row keeps the metadata without its per-sample lists."""
        from logprob_parity.results.rollout import MAIN_PAIR, ROLLOUT_SCHEMA, sample_table

        folder = self.rollouts_dir
        folder.mkdir(exist_ok=True)
        meta = dict(meta_obj.to_dict(), schema_version=ROLLOUT_SCHEMA)
        tables = iter(tables)
        first = next(tables, None)
        if first is None:
            first = sample_table([], [])
        schema = first.schema.with_metadata({META_KEY: json.dumps(meta, allow_nan=False)})

        def write(f: Any) -> None:
            with parquet_writer(f, schema) as w:
                w.write_table(first.cast(schema), row_group_size=ROW_GROUP)
                for t in tables:
                    w.write_table(t.cast(schema), row_group_size=ROW_GROUP)

        digest = _atomic_write(folder / f"{meta_obj.rollout_id}.parquet", write)
        s = meta_obj.summary.get(MAIN_PAIR, {})
        light = {k: v for k, v in meta.items() if k != "samples"}
        light["first_text"] = str((meta.get("prompts") or [_sampling_words(meta.get("sampling") or {})])[0])[:80]
        light["prompts"] = (meta.get("prompts") or [])[:1]
        with closing(self._db()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO rollouts VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    meta_obj.rollout_id,
                    meta_obj.created_ts or time.time(),
                    meta_obj.model,
                    meta_obj.dtype,
                    n_samples,
                    int(s.get("n_tokens") or 0),
                    s.get("max_abs_delta"),
                    s.get("mean_abs_delta"),
                    json.dumps(light),
                    digest,
                ),
            )

    def has_rollout(self, rollout_id: str) -> bool:
        with closing(self._db()) as db:
            row = db.execute("SELECT 1 FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        return row is not None and (self.rollouts_dir / f"{rollout_id}.parquet").is_file()

    def resolve_rollout_id(self, prefix: str) -> str:
        return self._by_prefix("rollouts", "rollout_id", prefix, "rollout", "rollouts")[0]

    def is_frontier(self, any_id: str) -> bool:
        """Whether a (prefix of an) id names a stored frontier."""
        return _resolves(self.resolve_frontier_id, any_id)

    def is_rollout(self, any_id: str) -> bool:
        """Whether a (prefix of an) id names a stored rollout rather than a comparison run."""
        return _resolves(self.resolve_rollout_id, any_id)

    def load_rollout(self, rollout_id: str) -> Any:
        import pyarrow.parquet as pq

        from logprob_parity.results.rollout import (
            INFO_COLUMNS,
            ROLLOUT_SCHEMA,
            Rollout,
            RolloutMeta,
            StoredSamples,
        )

        rid, expected = self._by_prefix("rollouts", "rollout_id", rollout_id, "rollout", "rollouts", ", sha256")
        path = self.rollouts_dir / f"{rid}.parquet"
        if not path.is_file():
            raise UserError(f"no stored rollout {rid}: its file is missing from {self.rollouts_dir}")
        try:
            if _sha256(path) != expected:
                raise UserError(f"stored rollout {rid} failed its integrity check (file changed since it was written)")
            schema = pq.read_schema(path)
            raw = json.loads(schema.metadata[META_KEY])
            if raw.get("rollout_id") != rid or raw.get("schema_version") != ROLLOUT_SCHEMA:
                raise UserError(f"stored rollout {rid} does not match its index entry (schema or id); delete and re-run it")
            missing = ROLLOUT_COLUMNS - set(schema.names)
            if missing:
                raise UserError(f"stored rollout {rid} lacks columns {sorted(missing)}; delete and re-run it")
            meta = RolloutMeta.from_dict(raw)
            if not meta.samples and set(INFO_COLUMNS) <= set(schema.names):  # a rescore: its samples stay in the file
                return Rollout(meta=meta, samples=StoredSamples(path, int(meta.sampling.get("records") or 0)), from_store=True)
            return Rollout.from_frame(meta, pq.read_table(path).to_pandas())
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise UserError(f"stored rollout {rid} is unreadable ({type(exc).__name__}: {exc})") from exc

    def list_rollouts(self) -> pd.DataFrame:
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT rollout_id, created, model, dtype, n_samples, n_tokens, max_abs_delta, mean_abs_delta, meta "
                "FROM rollouts ORDER BY created DESC"
            ).fetchall()
        cols = ["rollout_id", "created", "model", "dtype", "n_samples", "n_tokens", "max_abs_delta", "mean_abs_delta"]
        df = pd.DataFrame([r[:-1] for r in rows], columns=cols)
        df["created"] = pd.to_datetime(df["created"], unit="s", utc=True)
        metas = [json.loads(r[-1]) for r in rows]
        df["first_text"] = [m["first_text"] if "first_text" in m else str((m.get("prompts") or [""])[0])[:80] for m in metas]
        df["sampling"] = [_sampling_words(m.get("sampling") or {}) for m in metas]
        df["level"] = [(m.get("verdict") or {}).get("level", "") for m in metas]
        return df

    def delete_rollout(self, rollout_id: str) -> None:
        rid = self.resolve_rollout_id(rollout_id)
        with closing(self._db()) as db, db:
            db.execute("DELETE FROM rollouts WHERE rollout_id=?", (rid,))
        (self.rollouts_dir / f"{rid}.parquet").unlink(missing_ok=True)

    def list_runs(self) -> pd.DataFrame:
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT run_id, created, model, dtype, n_sequences, n_tokens, max_abs_delta, mean_abs_delta, meta "
                "FROM runs ORDER BY created DESC"
            ).fetchall()
        cols = ["run_id", "created", "model", "dtype", "n_sequences", "n_tokens", "max_abs_delta", "mean_abs_delta"]
        df = pd.DataFrame([r[:-1] for r in rows], columns=cols)
        df["created"] = pd.to_datetime(df["created"], unit="s", utc=True)
        metas = [json.loads(r[-1]) for r in rows]
        # index rows written before the index kept these carry the whole sequences list instead
        df["first_text"] = [m["first_text"] if "first_text" in m else _first_text(m) for m in metas]
        df["comparison"] = [m["comparison"] if "comparison" in m else _comparison_key(m) for m in metas]
        df["settings"] = [dict(m.get("settings") or {}) for m in metas]  # as run: the Runs page names those changed
        return df


def _sampling_words(s: dict[str, Any]) -> str:
    if not s:
        return ""
    if s.get("source") == "logged":
        return f"logged: {s.get('records')} sequences from {s.get('file')}"
    k = "" if s.get("top_k", -1) < 0 else f" top-k {s['top_k']}"
    return f"n={s.get('samples')} T={s.get('temperature'):g} top-p {s.get('top_p'):g}{k} ≤{s.get('max_tokens')} tok seed {s.get('seed')}"


def _checked_json(path: Path, expected: str, what: str) -> dict[str, Any]:
    """A stored JSON file whose checksum matches its index row, or a UserError that says what is wrong."""
    try:
        if _sha256(path) != expected:
            raise UserError(f"{what} failed its integrity check (file changed since it was written)")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: its file is missing from {path.parent}") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{what} is unreadable ({type(exc).__name__}: {exc})") from exc


def _resolves(resolve: Any, any_id: str) -> bool:
    """Whether `resolve` (one kind's prefix lookup) finds exactly one stored item for `any_id`."""
    try:
        resolve(any_id)
    except UserError:
        return False
    return True


def _atomic_write(target: Path, write: Any) -> str:
    """write(binary file) into a temp file beside `target`, fsync, rename over it; return its sha256.
    A half-written file is never found under the target's name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        digest = _sha256(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _comparison_key(meta: dict[str, Any]) -> str:
    """What the runs of one comparison share (everything but the dtype), so the Runs page can list
    a comparison in several dtypes as one row."""
    from logprob_parity.inputs.spec import content_hash

    texts = [s.get("text", "") for s in meta.get("sequences") or []]
    return content_hash(
        {
            "model": meta.get("model"),
            "identity": meta.get("model_identity"),
            "settings": meta.get("settings"),
            "top_k": meta.get("top_k"),
            "bos": meta.get("bos"),
            "texts": texts,
            "device": meta.get("device"),
            "versions": {k: (meta.get("env") or {}).get(k) for k in ("torch", "transformers", "vllm")},
        },
        16,
    )


def _first_text(meta: dict[str, Any]) -> str:
    seqs = meta.get("sequences") or [{}]
    return str(seqs[0].get("text", ""))[:80]
