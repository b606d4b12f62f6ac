"""What a run is: the inputs that can change a number, in canonical form, and their hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from logprob_parity.errors import UserError
from logprob_parity.inputs.settings import EngineSettings

DTYPES = ("float16", "bfloat16", "float32")
BOS_POLICIES = ("auto", "add", "none")
BACKENDS = ("hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
# vLLM computes and ships k logprobs for every prompt position; past this the cost grows with no use.
MAX_TOP_K = 100


@dataclass(frozen=True)
class RunSpec:
    """One comparison request: every dtype in `dtypes` becomes one stored run."""

    texts: tuple[str, ...]
    model: str | None = None  # None: the embedded demo model
    revision: str | None = None
    dtypes: tuple[str, ...] = ("float32",)
    backends: tuple[str, ...] = BACKENDS
    top_k: int = 5
    device: str = "auto"
    bos: str = "auto"
    settings: EngineSettings = field(default_factory=EngineSettings)
    truncate: bool = False  # keep the first positions of a prompt longer than the model allows
    noise_floor: bool = True  # measure each engine's own noise beside the gap (logprob_parity.analysis.floors)
    # what noise looks like: HF against itself in vLLM's place (engines.backends.hf.HFNullBackend), same view and verdict
    null: bool = False

    def validate(self) -> None:
        """Checks that need no model: fail fast, before anything loads."""
        if not self.texts:
            raise UserError("no prompt given: pass --prompt TEXT or --prompts FILE")
        for i, t in enumerate(self.texts):
            if not isinstance(t, str) or not t.strip():
                where = "the prompt" if len(self.texts) == 1 else f"prompt {i + 1}"
                raise UserError(f"{where} is empty; give some text to score")
        if not self.dtypes:
            raise UserError("no dtype given; choose from " + ", ".join(DTYPES))
        for d in self.dtypes:
            if d not in DTYPES:
                raise UserError(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
        if len(set(self.dtypes)) != len(self.dtypes):
            raise UserError("a dtype is listed twice")
        if sorted(self.backends) != sorted(BACKENDS):
            raise UserError(f"backends must be hf,vllm (got {','.join(self.backends)}): a comparison needs both")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise UserError(f"top-k must be a positive integer (got {self.top_k})")
        if self.top_k > MAX_TOP_K:
            raise UserError(f"top-k {self.top_k} is above the maximum of {MAX_TOP_K} prompt logprobs this tool asks vLLM for")
        self.settings.validate()
        if self.device not in DEVICES:
            raise UserError(f"unknown device {self.device!r}; choose from {', '.join(DEVICES)}")
        if self.bos not in BOS_POLICIES:
            raise UserError(f"unknown BOS policy {self.bos!r}; choose from {', '.join(BOS_POLICIES)}")


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces, so equal inputs hash equal."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def content_hash(obj: Any, length: int = 20) -> str:
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:length]
