"""Where logprob-parity keeps its files."""

from __future__ import annotations

import os
from pathlib import Path


def store_root() -> Path:
    """`$LOGPROB_PARITY_HOME`, default `~/.cache/logprob-parity` (DESIGN.md)."""
    env = os.environ.get("LOGPROB_PARITY_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "logprob-parity"
