"""What a run is: the inputs that can change a number, in canonical form, and their hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from core.errors import UserError

DTYPES = ("float16", "bfloat16", "float32")
BOS_POLICIES = ("auto", "add", "none")
BACKENDS = ("hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
# vLLM computes and ships k logprobs for every prompt position; past this the cost grows with no use.
MAX_TOP_K = 100


@dataclass(frozen=True)
class EngineSettings:
    """Engine knobs that can move a logprob. None means "the engine's default for this device"."""

    # vLLM
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    seed: int = 0
    attention_backend: str | None = None
    # vLLM parallelism; None: chosen from the model's size and the GPUs present (core.parallel)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    distributed_executor_backend: str | None = None  # "ray": a Ray cluster's GPUs; None: vLLM's choice
    # HF
    attn_implementation: str | None = None
    hf_batch_size: int = 1  # sequences per forward pass; 1 means no padding and no batch effects
    hf_device_map: str | None = None  # "auto": accelerate spreads the model over the GPUs
    hf_compile: bool = False  # torch.compile the forward and the logprob blocks: faster bulk scoring, slower first call
    # both
    trust_remote_code: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise UserError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    def vllm_part(self) -> dict[str, Any]:
        d = self.to_dict()
        for name in HF_ONLY:
            d.pop(name)
        return d

    def hf_part(self) -> dict[str, Any]:
        d = self.to_dict()
        return {name: d[name] for name in (*HF_ONLY, "trust_remote_code")}


HF_ONLY = ("attn_implementation", "hf_batch_size", "hf_device_map", "hf_compile")


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
            raise UserError(
                f"top-k {self.top_k} is above the maximum of {MAX_TOP_K} prompt logprobs this tool asks vLLM for"
            )
        if not isinstance(self.settings.hf_batch_size, int) or self.settings.hf_batch_size < 1:
            raise UserError(f"hf_batch_size must be a positive integer (got {self.settings.hf_batch_size})")
        if self.device not in DEVICES:
            raise UserError(f"unknown device {self.device!r}; choose from {', '.join(DEVICES)}")
        if self.bos not in BOS_POLICIES:
            raise UserError(f"unknown BOS policy {self.bos!r}; choose from {', '.join(BOS_POLICIES)}")


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces, so equal inputs hash equal."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def content_hash(obj: Any, length: int = 20) -> str:
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:length]
