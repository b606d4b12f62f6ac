"""Rollouts logged elsewhere (verl, OpenRLHF, TRL, one's own loop): read, mapped and checked.

One sequence a record, as JSONL or Parquet, with these fields (other names mapped with `--map
FIELD=COLUMN,...`), or the project's own `rollout --json` output as it is:
- `prompt_token_ids` (or `prompt`, text the model's tokenizer encodes under the BOS policy), and
  `completion_token_ids`; or `token_ids`, the whole sequence, whose last len(logprobs) ids are the completion;
- `logprobs`: the rollout engine's logprob of each completion token;
- optional `temperature`, `top_p`, `top_k` (how it sampled), `step`, `id`.
Every record is checked before anything runs: a bad one is named with its field and nothing is scored
or stored. Checked: a field is there and of the right kind, the lengths agree, every id is in the
model's vocabulary, no logprob is NaN or above 0, and where a record carries both its prompt text and
ids, the model's tokenizer makes those ids of that text (else the rollouts came from another tokenizer).

A file is read a line (JSONL) or a row group (Parquet) at a time; a rescore stages the checked
records in an Arrow file on disk and reads them back a batch at a time (`stage_logged`), so a file
of 100,000 sequences is never held in memory. `rollout --json` output, one JSON object, is read whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.errors import UserError

FIELDS = (
    "prompt_token_ids",
    "prompt",
    "token_ids",
    "completion_token_ids",
    "logprobs",
    "temperature",
    "top_p",
    "top_k",
    "step",
    "id",
)
MAX_RECORDS = 100_000
POSITIVE_SLACK = 1e-5  # float32 rounding can put a certain token's logprob a hair above 0, not more


@dataclass(frozen=True)
class LoggedSequence:
    """One logged rollout sequence, checked."""

    record: int  # its number in the file, from 1
    id: str | None
    step: int | None
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class LoggedSet:
    sequences: tuple[LoggedSequence, ...]
    source: str  # the file's name
    digest: str  # sha256 of every sequence's ids, logprobs and sampling: the rescore's identity

    @property
    def n_tokens(self) -> int:
        return sum(len(s.completion_token_ids) for s in self.sequences)


def parse_mapping(text: str | None) -> dict[str, str]:
    """'logprobs=old_logp,prompt_token_ids=prompts' -> {field: column}; refuses unknown fields."""
    out: dict[str, str] = {}
    for part in [p.strip() for p in (text or "").split(",") if p.strip()]:
        field, sep, column = part.partition("=")
        field, column = field.strip(), column.strip()
        if not sep or not column:
            raise UserError(f"--map takes FIELD=COLUMN pairs separated by commas (got {part!r})")
        if field not in FIELDS:
            raise UserError(f"--map: {field!r} is not a field; the fields are {', '.join(FIELDS)}")
        out[field] = column
    return out


def _records(source: bytes | Path, name: str) -> Iterator[dict[str, Any]]:
    """The file's records in order: JSONL lines, Parquet rows, or the samples of `rollout --json`
    output. `source` is the file (read a line or a row group at a time) or its bytes (an upload)."""
    suffix = Path(name).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(io.BytesIO(source) if isinstance(source, bytes) else str(source))
        except Exception as exc:
            raise UserError(f"{name} is not a readable Parquet file ({exc})") from None
        for batch in f.iter_batches(batch_size=4096):
            yield from batch.to_pylist()
        return
    if suffix not in (".jsonl", ".json"):
        raise UserError(
            f"{name}: unsupported file type {suffix!r}; use .jsonl (one record a line), .parquet, or .json "
            "(the output of `logprob-parity rollout --json`)"
        )
    with io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb") as f:
        if suffix == ".json":  # one object, the project's own output: read whole (a .jsonl streams)
            try:
                obj = json.loads(_text(f.read(), name, None))
            except ValueError as exc:
                raise UserError(f"{name} is not JSON ({exc})") from None
            yield from _from_rollout_json(obj, name)
            return
        for n, raw in enumerate(f, 1):
            line = _text(raw, name, n)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{name}, line {n}: not JSON ({exc.msg}); nothing was scored") from None
            if not isinstance(rec, dict):
                raise UserError(f"{name}, line {n}: a record must be a JSON object with the fields {', '.join(FIELDS[:5])}")
            yield rec


def _text(raw: bytes, name: str, line: int | None) -> str:
    """Bytes of the file (or of one of its lines) as text; a UTF-8 byte-order mark is dropped."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"{name}, line {line}" if line is not None else name
        raise UserError(f"{where} is not UTF-8 text (byte {exc.start} is invalid)") from None


def _from_rollout_json(obj: Any, name: str) -> Iterator[dict[str, Any]]:
    """`rollout --json` output (one object, or a list for several dtypes: the first dtype's is used, the
    rollout's samples and their decode_raw logprobs being what a rollout engine logs)."""
    first = obj[0] if isinstance(obj, list) and obj else obj
    if not isinstance(first, dict) or "samples" not in first:
        raise UserError(f"{name} is JSON but not `logprob-parity rollout --json` output (no 'samples'); use .jsonl for records")
    sampling = first.get("sampling") or {}
    for s in first["samples"]:
        yield {
            "prompt_token_ids": s.get("prompt_token_ids"),
            "completion_token_ids": s.get("completion_token_ids"),
            "logprobs": [p["logprob"]["decode_raw"] for p in s.get("positions", [])],
            "temperature": sampling.get("temperature"),
            "top_p": sampling.get("top_p"),
            "top_k": sampling.get("top_k"),
            "id": f"seed {s.get('seed')}",
        }


def _ids(rec: dict[str, Any], field: str, where: str) -> list[int]:
    v = rec.get(field)
    if hasattr(v, "tolist"):
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise UserError(f"{where}: {field} must be a list of token ids (whole numbers)")
    return [int(x) for x in v]


def _number(rec: dict[str, Any], field: str, default: Any, where: str, kind: type) -> Any:
    v = rec.get(field)
    if v is None:
        return default
    try:
        out = kind(v)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {field} must be a number (got {v!r})") from None
    return out


def read_logged(
    source: bytes | Path, name: str, mapping: dict[str, str], tokenizer: Any, bos: str, vocab: int | None
) -> LoggedSet:
    """Every record of the file, mapped and checked, in memory (a few records; a rescore stages them,
    `stage_logged`)."""
    digest = hashlib.sha256()
    out = tuple(iter_logged(source, name, mapping, tokenizer, bos, vocab, digest))
    return LoggedSet(out, Path(name).name, digest.hexdigest()[:32])


def iter_logged(
    source: bytes | Path, name: str, mapping: dict[str, str], tokenizer: Any, bos: str, vocab: int | None, digest: Any
) -> Iterator[LoggedSequence]:
    """The file's records one at a time, mapped and checked (UserError naming the record and field);
    each one's ids, logprobs and sampling go into `digest` (hashlib), the rescore's identity."""
    from logprob_parity.inputs.tokens import encode_texts

    n = 0
    for n, raw in enumerate(_records(source, name), 1):
        if n > MAX_RECORDS:
            raise UserError(f"{name} holds more than {MAX_RECORDS:,} records; split it")
        rec = {f: raw.get(mapping.get(f, f)) for f in FIELDS}
        rid = rec.get("id")
        where = f"{name}, record {n}" + (f" (id {rid!r})" if rid is not None else "")
        if rec["logprobs"] is None:
            raise UserError(f"{where} has no logprobs (map its column with --map logprobs=NAME)")
        lps = rec["logprobs"].tolist() if hasattr(rec["logprobs"], "tolist") else rec["logprobs"]
        if not isinstance(lps, (list, tuple)) or not lps:
            raise UserError(f"{where}: logprobs must be a non-empty list of numbers, one a completion token")
        try:
            lps = [float(x) for x in lps]
        except (TypeError, ValueError):
            raise UserError(f"{where}: logprobs must hold numbers only") from None
        for i, x in enumerate(lps):
            if math.isnan(x):
                raise UserError(f"{where}: logprobs[{i}] is NaN")
            if x > POSITIVE_SLACK:
                raise UserError(
                    f"{where}: logprobs[{i}] is {x:g}, above 0; a log probability is never positive "
                    "(is this column probabilities, or logits?)"
                )
        if rec["completion_token_ids"] is not None:
            completion = _ids(rec, "completion_token_ids", where)
            if rec["prompt_token_ids"] is not None:
                prompt = _ids(rec, "prompt_token_ids", where)
            elif rec["prompt"] is not None:
                if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                    raise UserError(f"{where}: prompt must be non-empty text")
                (prompt,), _ = encode_texts(tokenizer, [rec["prompt"]], bos)
            else:
                raise UserError(f"{where} has completion_token_ids but no prompt_token_ids or prompt (map them with --map)")
        elif rec["token_ids"] is not None:
            whole = _ids(rec, "token_ids", where)
            if len(whole) <= len(lps):
                raise UserError(
                    f"{where}: token_ids has {len(whole)} ids, not more than its {len(lps)} logprobs: no prompt is left"
                )
            prompt, completion = whole[: len(whole) - len(lps)], whole[len(whole) - len(lps) :]
        else:
            raise UserError(f"{where} has no completion_token_ids or token_ids (map them with --map)")
        if len(completion) != len(lps):
            raise UserError(
                f"{where}: logprobs has {len(lps)} values but completion_token_ids has {len(completion)} ids; "
                "they must be one a completion token"
            )
        if not prompt:
            raise UserError(f"{where}: the prompt is empty; the first completion token needs a prompt before it")
        if vocab is not None:
            for field, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
                bad = next((i for i, x in enumerate(ids) if not 0 <= x < vocab), None)
                if bad is not None:
                    raise UserError(
                        f"{where}: {field}[{bad}] = {ids[bad]} is outside this model's vocabulary ({vocab:,} "
                        "entries): these rollouts were not made with this model's tokenizer"
                    )
        if rec["prompt"] is not None and rec["prompt_token_ids"] is not None and isinstance(rec["prompt"], str):
            (mine,), _ = encode_texts(tokenizer, [rec["prompt"]], "none")
            if mine != prompt[len(prompt) - len(mine) :]:
                raise UserError(
                    f"{where}: prompt_token_ids are not what this model's tokenizer makes of its prompt text: "
                    "the rollouts were tokenized by another tokenizer"
                )
        temperature = _number(rec, "temperature", 1.0, where, float)
        top_p = _number(rec, "top_p", 1.0, where, float)
        top_k = _number(rec, "top_k", -1, where, int)
        if not temperature > 0 or not 0 < top_p <= 1:
            raise UserError(f"{where}: temperature must be above 0 and top_p in (0, 1] (got {temperature}, {top_p})")
        step = _number(rec, "step", None, where, int)
        seq = LoggedSequence(
            n,
            None if rid is None else str(rid),
            step,
            tuple(prompt),
            tuple(completion),
            tuple(lps),
            temperature,
            top_p,
            top_k if top_k > 0 else -1,
        )
        digest.update(
            json.dumps(
                [seq.prompt_token_ids, seq.completion_token_ids, seq.logprobs, seq.temperature, seq.top_p, seq.top_k]
            ).encode()
        )
        yield seq
    if not n:
        raise UserError(f"{name} holds no records")


STAGED_ROWS = 4096  # sequences an Arrow record batch of the staged file


@dataclass(frozen=True, eq=False)
class LoggedIndex:
    """A logged file read once and checked, its sequences staged in an Arrow file on disk (`path`)
    and read back a batch at a time (`read`): a rescore of 100,000 sequences holds a few numbers a
    sequence, never the sequences. The per-sequence arrays are in file order."""

    path: Path
    source: str  # the file's name
    digest: str  # as LoggedSet.digest
    prompt_len: np.ndarray  # int64 [sequences]
    completion_len: np.ndarray  # int64 [sequences]
    temperature: np.ndarray  # float64 [sequences]
    top_p: np.ndarray  # float64 [sequences]
    top_k: np.ndarray  # int64 [sequences]

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def n_tokens(self) -> int:
        return int(self.completion_len.sum())

    def read(self, idx: Any) -> list[LoggedSequence]:
        """Sequences `idx` (file order numbers, from 0), from the staged file."""
        import pyarrow as pa

        out: dict[int, LoggedSequence] = {}
        idx = [int(i) for i in idx]
        with pa.memory_map(str(self.path)) as src:
            reader = pa.ipc.open_file(src)
            by_batch: dict[int, list[int]] = {}
            for i in idx:
                by_batch.setdefault(i // STAGED_ROWS, []).append(i)
            for b, members in by_batch.items():
                rows = pa.Table.from_batches([reader.get_batch(b)]).take([i % STAGED_ROWS for i in members]).to_pylist()
                for i, r in zip(members, rows):
                    out[i] = LoggedSequence(
                        r["record"],
                        r["id"],
                        r["step"],
                        tuple(r["prompt"]),
                        tuple(r["completion"]),
                        tuple(r["logprobs"]),
                        r["temperature"],
                        r["top_p"],
                        r["top_k"],
                    )
        return [out[i] for i in idx]


def stage_logged(
    source: bytes | Path, name: str, mapping: dict[str, str], tokenizer: Any, bos: str, vocab: int | None, path: Path
) -> LoggedIndex:
    """Every record checked (`iter_logged`) and written to the Arrow file `path`, STAGED_ROWS
    sequences a record batch; nothing of the file is kept in memory but a few numbers a sequence.
    A bad record raises before anything is scored, and the staged file is removed."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("record", pa.int64()),
            ("id", pa.string()),
            ("step", pa.int64()),
            ("prompt", pa.list_(pa.int64())),
            ("completion", pa.list_(pa.int64())),
            ("logprobs", pa.list_(pa.float64())),
            ("temperature", pa.float64()),
            ("top_p", pa.float64()),
            ("top_k", pa.int64()),
        ]
    )
    digest = hashlib.sha256()
    numbers: dict[str, list[Any]] = {k: [] for k in ("prompt_len", "completion_len", "temperature", "top_p", "top_k")}
    rows: list[LoggedSequence] = []
    path.parent.mkdir(parents=True, exist_ok=True)

    def flush(w: Any) -> None:
        cols = {
            "record": [r.record for r in rows],
            "id": [r.id for r in rows],
            "step": [r.step for r in rows],
            "prompt": [r.prompt_token_ids for r in rows],
            "completion": [r.completion_token_ids for r in rows],
            "logprobs": [r.logprobs for r in rows],
            "temperature": [r.temperature for r in rows],
            "top_p": [r.top_p for r in rows],
            "top_k": [r.top_k for r in rows],
        }
        w.write_batch(pa.RecordBatch.from_pydict(cols, schema=schema))
        rows.clear()

    try:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
            for seq in iter_logged(source, name, mapping, tokenizer, bos, vocab, digest):
                rows.append(seq)
                numbers["prompt_len"].append(len(seq.prompt_token_ids))
                numbers["completion_len"].append(len(seq.completion_token_ids))
                numbers["temperature"].append(seq.temperature)
                numbers["top_p"].append(seq.top_p)
                numbers["top_k"].append(seq.top_k)
                if len(rows) == STAGED_ROWS:
                    flush(w)
            if rows:
                flush(w)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return LoggedIndex(
        path,
        Path(name).name,
        digest.hexdigest()[:32],
        np.asarray(numbers["prompt_len"], dtype=np.int64),
        np.asarray(numbers["completion_len"], dtype=np.int64),
        np.asarray(numbers["temperature"], dtype=np.float64),
        np.asarray(numbers["top_p"], dtype=np.float64),
        np.asarray(numbers["top_k"], dtype=np.int64),
    )
