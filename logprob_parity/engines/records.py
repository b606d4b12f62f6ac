"""Typed records that cross the process boundary between the pool and its hosts.

A `LoadRequest` says which engine to load (it is also the engine's identity in the pool); a
`HostRequest` is one message to a host, a `HostReply` its answer. They travel over an
authenticated Unix socket to our own child process, never through the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from logprob_parity.inputs.settings import EngineSettings


@dataclass(frozen=True)
class LoadRequest:
    """One engine: a backend, a model folder, a dtype, a device, settings and the context length."""

    backend: str
    model_path: str
    dtype: str
    device: str
    settings: Any = field(default_factory=EngineSettings)  # an EngineSettings
    max_model_len: int = 256

    def key(self) -> str:
        """The pool's key: only the settings this backend reads split its engines (an HF knob never
        restarts vLLM)."""
        from logprob_parity.inputs.spec import canonical_json

        part = self.settings.hf_part() if self.backend in ("hf", "hf_null") else self.settings.vllm_part()
        return canonical_json(
            {
                "backend": self.backend,
                "model_path": self.model_path,
                "dtype": self.dtype,
                "device": self.device,
                "max_model_len": self.max_model_len,
                "settings": part,
            }
        )

    @property
    def label(self) -> str:
        return f"{self.backend} ({self.dtype})"

    def host_env(self) -> dict[str, str]:
        """Environment the engine's host process needs before it imports its engine."""
        env: dict[str, str] = {}
        if self.backend == "vllm" and getattr(self.settings, "batch_invariant", False):
            env["VLLM_BATCH_INVARIANT"] = "1"
        if self.backend == "vllm" and self.sleeps():
            env.update(pinned_register_env())
        return env

    def sleeps(self) -> bool:
        """Whether this engine sleeps between turns instead of stopping (engines.memory.sleeps_in_turn)."""
        from logprob_parity.engines.memory import sleeps_in_turn

        return sleeps_in_turn(self.device, self.settings)

    def backend_kwargs(self) -> dict[str, Any]:
        """The backend constructor's arguments."""
        return {
            "model_path": self.model_path,
            "dtype": self.dtype,
            "device": self.device,
            "settings": self.settings,
            "max_model_len": self.max_model_len,
        }


@dataclass(frozen=True)
class HostRequest:
    """op: load (with `load`), score, generate or close; args: the backend method's arguments."""

    op: str
    args: tuple[Any, ...] = ()
    load: LoadRequest | None = None


@dataclass(frozen=True)
class HostReply:
    """ok with a value, or an error of `kind` user (the user can act on it), engine or protocol."""

    ok: bool
    value: Any = None
    kind: str = ""
    text: str = ""


PINNED_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pinned_register_env() -> dict[str, str]:
    """torch's pinned host memory by malloc, pages touched by 8 threads, then cudaHostRegister, not
    one cudaHostAlloc: a vLLM that sleeps (engines in turn) backs its weights up into pinned memory,
    and its first sleep of a 46 GB model took 26.9 s on an H100 the plain way (HF's own copy, made
    the threaded way in `engines/hostcopy.py`, took 5.4 s). Later sleeps reuse torch's cached pinned
    blocks either way. Added to what the user set, under the name they set it (torch reads
    PYTORCH_ALLOC_CONF first); nothing where they chose these keys themselves."""
    name = "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    have = os.environ.get(name, "")
    if "pinned_use_cuda_host_register" in have:
        return {}
    return {name: f"{have},{PINNED_REGISTER}" if have else PINNED_REGISTER}
