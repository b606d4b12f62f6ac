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
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.errors import UserError
from core.paths import store_root
from core.run import SCHEMA_VERSION, Run, SequenceResult, table_columns

META_KEY = b"logprob_parity_meta"
REQUIRED_COLUMNS = {
    "seq", "index", "token_id", "token", "piece", "scored", "hf_logprob", "vllm_logprob", "hf_rank", "vllm_rank",
    "hf_prob", "vllm_prob", "delta", "abs_delta", "prob_delta", "kl_topk", "argmax_agree",
    "hf_topk_ids", "hf_topk_logprobs", "vllm_topk_ids", "vllm_topk_logprobs", "hf_at_vllm_topk",
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
"""


class Store:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else store_root()
        self.runs_dir = self.root / "runs"
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
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(run.to_frame(), preserve_index=False)
        meta = dict(run.meta, schema_version=SCHEMA_VERSION)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: json.dumps(meta)})
        fd, tmp = tempfile.mkstemp(prefix=f".{run.run_id}-", suffix=".tmp", dir=self.runs_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            digest = _sha256(Path(tmp))
            os.replace(tmp, self.path_of(run.run_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        s = run.summary
        with closing(self._db()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    run.run_id,
                    meta.get("created_ts", time.time()),
                    meta["model"],
                    meta["dtype"],
                    len(run.sequences),
                    s["n_tokens"],
                    s["max_abs_delta"],
                    s["mean_abs_delta"],
                    json.dumps(meta),
                    digest,
                ),
            )
            if request_key:
                db.execute("INSERT OR REPLACE INTO requests VALUES (?,?)", (request_key, run.run_id))

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

    def resolve_id(self, run_id: str) -> str:
        """A full id or a unique prefix of one."""
        if not run_id or not all(c in "0123456789abcdef" for c in run_id):
            raise UserError(f"{run_id!r} is not a run id (hex digits)")
        with closing(self._db()) as db:
            rows = db.execute("SELECT run_id FROM runs WHERE run_id LIKE ?", (run_id + "%",)).fetchall()
        if not rows:
            raise UserError(f"no stored run with id {run_id!r} (see `logprob-parity runs`)")
        if len(rows) > 1:
            raise UserError(f"run id prefix {run_id!r} is ambiguous ({len(rows)} runs)")
        return rows[0][0]

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
            table = pq.read_table(path)
            meta = json.loads(table.schema.metadata[META_KEY])
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise UserError(f"stored run {run_id} is unreadable ({type(exc).__name__}: {exc})") from exc
        if meta.get("run_id") != run_id or meta.get("schema_version") != SCHEMA_VERSION:
            raise UserError(f"stored run {run_id} does not match its index entry (schema or id); delete and re-run it")
        missing = REQUIRED_COLUMNS - set(table.column_names)
        if missing:
            raise UserError(f"stored run {run_id} lacks columns {sorted(missing)}; delete and re-run it")
        try:
            cols = table_columns(table)
        except ValueError as exc:
            raise UserError(f"stored run {run_id} is unreadable ({exc}); delete and re-run it") from exc
        bounds = np.searchsorted(cols["seq"], np.arange(len(meta["sequences"]) + 1))  # rows are stored in seq order
        seqs = tuple(
            SequenceResult.from_columns(cols, slice(bounds[i], bounds[i + 1]), info) for i, info in enumerate(meta["sequences"])
        )
        return Run(meta=meta, sequences=seqs, from_store=True)

    def list_runs(self) -> pd.DataFrame:
        with closing(self._db()) as db:
            rows = db.execute(
                "SELECT run_id, created, model, dtype, n_sequences, n_tokens, max_abs_delta, mean_abs_delta, meta "
                "FROM runs ORDER BY created DESC"
            ).fetchall()
        cols = ["run_id", "created", "model", "dtype", "n_sequences", "n_tokens", "max_abs_delta", "mean_abs_delta"]
        df = pd.DataFrame([r[:-1] for r in rows], columns=cols)
        df["created"] = pd.to_datetime(df["created"], unit="s", utc=True)
        df["first_text"] = [_first_text(json.loads(r[-1])) for r in rows]
        return df


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _first_text(meta: dict[str, Any]) -> str:
    seqs = meta.get("sequences") or [{}]
    return str(seqs[0].get("text", ""))[:80]
