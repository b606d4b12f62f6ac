"""Prompt sets from files: .txt (one prompt a line), .jsonl ({"text": ...}) or .csv (a `text` column)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logprob_parity.errors import UserError

MAX_UPLOAD_BYTES = 20 << 20
# The forum sentence: the text people paste into the usual vLLM-vs-HF scripts.
SEED_TEXT = (
    "Dave lives in Palm Coast, FL and is a lawyer. His personal interests include playing guitar, "
    "hiking, and spending time with his family."
)


@dataclass(frozen=True)
class PromptSet:
    texts: tuple[str, ...]
    skipped: tuple[str, ...] = field(default=())  # one line per dropped entry, with its line number


def read_prompt_file(path: str | Path) -> PromptSet:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{str(p)!r} is a folder: give a prompt file in it (.txt, .jsonl or .csv)")
    if not p.is_file():
        raise UserError(f"prompt file {str(p)!r} does not exist")
    return parse_prompts(p.read_bytes(), p.name)


def parse_prompts(data: bytes, name: str) -> PromptSet:
    """Parse uploaded or on-disk bytes; keeps the good entries and names the bad ones."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise UserError(f"{name} is {len(data) >> 20} MiB; the limit is {MAX_UPLOAD_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name} is not UTF-8 text (byte {exc.start} is invalid)") from exc
    if "\x00" in text:
        raise UserError(f"{name} looks binary (contains NUL bytes), not a prompt file")
    suffix = Path(name).suffix.lower()
    if suffix == ".jsonl":
        texts, skipped = _jsonl(text)
    elif suffix == ".csv":
        texts, skipped = _csv(text, name)
    elif suffix in (".txt", ""):
        texts, skipped = [line for line in text.splitlines() if line.strip()], []
    else:
        raise UserError(f"{name}: unsupported file type {suffix!r}; use .txt, .jsonl or .csv")
    if not texts:
        detail = f" ({len(skipped)} bad entries: {'; '.join(skipped[:3])})" if skipped else ""
        raise UserError(f"{name} holds no prompts{detail}")
    return PromptSet(tuple(texts), tuple(skipped))


def _jsonl(text: str) -> tuple[list[str], list[str]]:
    texts, skipped = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            skipped.append(f"line {n}: not JSON ({exc.msg})")
            continue
        value = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(value, str) or not value.strip():
            skipped.append(f'line {n}: no non-empty "text" string')
            continue
        texts.append(value)
    return texts, skipped


def _csv(text: str, name: str) -> tuple[list[str], list[str]]:
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames or "text" not in reader.fieldnames:
        cols = ", ".join(reader.fieldnames or []) or "none"
        raise UserError(f"{name} has no 'text' column (columns: {cols})")
    texts, skipped = [], []
    for n, row in enumerate(reader, 2):
        value = row.get("text")
        if value is None or not value.strip():
            skipped.append(f"line {n}: empty text")
        else:
            texts.append(value)
    return texts, skipped


def filler_ids(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """n token-id sequences of exactly `length` ids (the tokenizer's BOS first, when it has one),
    cut from the bundled English sentences: a load of realistic size for timing a model, the same
    ids every time for the same tokenizer."""
    lines = (Path(__file__).resolve().parent.parent / "data" / "sentences.txt").read_text().splitlines()
    text = " ".join(lines) * (1 + n * length // 150)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids[i * 37 : i * 37 + length - len(bos)] for i in range(n)]


def sample_set(name: str = "sentences.txt") -> PromptSet:
    """A prompt set bundled with the package (logprob_parity/data): the Prompt set page's one-click sample."""
    data = Path(__file__).resolve().parent.parent / "data" / name
    return parse_prompts(data.read_bytes(), name)
