"""Typed records that cross the process boundary between the pool and its hosts.

A `LoadRequest` says which engine to load (it is also the engine's identity in the pool); a
`HostRequest` is one message to a host, a `HostReply` its answer. They travel over an
authenticated Unix socket to our own child process, never through the store.
"""

from __future__ import annotations

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
        if self.backend == "vllm" and getattr(self.settings, "batch_invariant", False):
            return {"VLLM_BATCH_INVARIANT": "1"}
        return {}

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
