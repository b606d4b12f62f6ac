"""The backend contract: load a model once, score many token-id sequences, report what ran."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from logprob_parity.engines.scores import TokenScores
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import EngineSettings

BACKEND_REGISTRY: dict[str, str] = {
    "hf": "logprob_parity.engines.backends.hf:HFBackend",
    "vllm": "logprob_parity.engines.backends.vllm:VLLMBackend",
    "fake": "logprob_parity.engines.backends.fake:FakeBackend",  # tests of the plumbing only (see its module)
    # HF against itself in vLLM's place: a null comparison (`compare --null`), what noise looks like
    "hf_null": "logprob_parity.engines.backends.hf:HFNullBackend",
}

# Set to 1 in an engine host's environment: the fake backend plays the hf and vllm roles there.
FAKE_ENV = "LPP_FAKE_ENGINES"

INSTALL_HINTS: dict[str, str] = {
    "hf": "pip install 'logprob-parity' (needs torch and transformers)",
    "vllm": "pip install 'logprob-parity[gpu]' on a CUDA machine, or 'logprob-parity[cpu]' for vLLM's CPU build",
    "fake": "it ships with logprob-parity",
    "hf_null": "pip install 'logprob-parity' (needs torch and transformers)",
}


class Backend(ABC):
    """Both engines expose the same methods, so the comparison code never branches on the engine."""

    name: str = ""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: str,
        settings: EngineSettings,
        max_model_len: int,
    ) -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        self.settings = settings
        self.max_model_len = max_model_len

    @classmethod
    def prefork(cls) -> None:
        """Work every process of this engine does once, done in the engine zygote before it forks
        hosts (logprob_parity.engines.zygote_server), so that each forked host inherits it done.
        Nothing by default."""
        return

    @abstractmethod
    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[Any] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: Any = None,
    ) -> list[TokenScores]:
        """Score every position of every sequence; `gather_ids[i]` is an int array [T, k] of extra
        ids whose logprobs to return (-1 where none). batch_size: sequences per engine call
        (None: the engine's default). full: the folder of the exact full-vocabulary KL
        (logprob_parity.engines.fullvocab): vLLM writes its full logprobs there, HF reads them and returns
        `kl_full`; None leaves it out."""

    @abstractmethod
    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each sequence, exactly max_new_tokens ids."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Versions, device and resolved settings, recorded with each run."""

    def sleep(self) -> bool:
        """Leave the device, keeping the model in host memory for `wake` (engines in turn,
        logprob_parity.analysis.turns). False: this engine cannot, and the pool stops it instead."""
        return False

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Take the device again after `sleep`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine and any process-wide state it set up: the host then exits, or loads the next
        model in this process (a swap); it collects the garbage itself."""


def load_backend_class(name: str) -> Any:
    """Import a backend on first use, with an install hint when its engine is missing. With
    LPP_FAKE_ENGINES=1 in the host's environment, the fake backend plays every role."""
    import os

    role = None
    if os.environ.get(FAKE_ENV) == "1" and name in ("hf", "vllm", "hf_null"):
        name = "hf" if name == "hf_null" else name
        name, role = "fake", name  # the fake backend plays the role it stands in for
    try:
        target = BACKEND_REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown backend {name!r}; choose from {', '.join(BACKEND_REGISTRY)}") from None
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserError(f"backend {name!r} is not installed ({exc.name} missing): {INSTALL_HINTS[name]}") from exc
    cls = getattr(module, cls_name)
    if role is not None:
        from functools import partial

        return partial(cls, role=role)
    return cls


def apply_tf32(settings: EngineSettings) -> None:
    """The tf32 setting, in this engine's process (each engine has its own host process): TF32
    matmuls and convolutions for float32 on NVIDIA GPUs. Off leaves PyTorch's defaults alone."""
    if getattr(settings, "tf32", False):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
