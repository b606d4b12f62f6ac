"""Where logprob-parity keeps its files."""

from __future__ import annotations

import os
from pathlib import Path


def store_root() -> Path:
    """`$LOGPROB_PARITY_HOME`, default `~/.cache/logprob-parity` (DESIGN.md)."""
    env = os.environ.get("LOGPROB_PARITY_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "logprob-parity"


def write_text_atomic(out: str | os.PathLike, text: str) -> None:
    """`text` into a temp file beside `out`, then renamed over it: a report or JSON export is never
    found half-written."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
