"""The engine settings registry: every knob that can move a logprob, declared once.

Why one registry: the CLI flags (`compare --help`), the dashboard's Engine settings form, the
`EngineSettings` record, the run id and the backends' constructor arguments are all generated from
`SETTINGS`. Adding a `Setting` here is the whole change; nothing else maps settings by hand.

A setting whose value is None means "the engine's default for this device". A `passthrough`
setting is handed to its backend's constructor under its own name whenever it is not None, so an
engine option needs no plumbing of its own (lm-evaluation-harness passes engine options the same way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from logprob_parity.errors import UserError
from logprob_parity.inputs.sizes import parse_size


@dataclass(frozen=True)
class Setting:
    """One engine setting.

    name: the attribute on EngineSettings, the CLI flag (`--name-with-dashes`) and the run-id key.
    kind: bool, int, float or str. default: None means the engine's own default.
    backend: which backend reads it (vllm, hf or both); only that backend's engines restart when it changes.
    in_run_id: whether it enters the run id (a setting that cannot change a number may stay out).
    passthrough: handed to the backend's constructor as `name=value` when not None.
    choices: allowed values (str settings). minimum: the smallest allowed number.
    label, help: what the form and `--help` show.
    """

    name: str
    kind: type
    default: Any
    backend: str
    help: str
    label: str = ""
    in_run_id: bool = True
    passthrough: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    # a str setting's own reading of its value: raises UserError in words when it cannot (a size)
    parse: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def optional(self) -> bool:
        return self.default is None

    def check(self, value: Any) -> Any:
        """The value in this setting's type, or a UserError that names the setting."""
        if value is None:
            if self.optional:
                return None
            raise UserError(f"engine setting {self.name} needs a value")
        ok = isinstance(value, self.kind) and not (self.kind is int and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UserError(f"engine setting {self.name} must be {self.kind.__name__} (got {value!r})")
        if self.choices is not None and value not in self.choices:
            raise UserError(f"engine setting {self.name} must be one of {', '.join(map(str, self.choices))} (got {value!r})")
        if self.minimum is not None and value < self.minimum:
            raise UserError(f"engine setting {self.name} must be at least {self.minimum:g} (got {value})")
        if self.maximum is not None and value > self.maximum:
            raise UserError(f"engine setting {self.name} must be at most {self.maximum:g} (got {value})")
        if self.parse is not None:
            self.parse(value)
        return value


ATTENTION_BACKENDS = ("FLEX_ATTENTION", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "CPU_ATTN")

SETTINGS: tuple[Setting, ...] = (
    # vLLM
    Setting(
        "enforce_eager",
        bool,
        True,
        "vllm",
        "skip torch.compile and CUDA graphs (off: vLLM compiles and captures graphs)",
        label="vLLM enforce_eager",
        passthrough=True,
    ),
    Setting(
        "enable_prefix_caching",
        bool,
        False,
        "vllm",
        "reuse KV blocks of shared prefixes across requests",
        label="vLLM prefix caching",
        passthrough=True,
    ),
    Setting(
        "enable_chunked_prefill",
        bool,
        None,
        "vllm",
        "split long prompts into chunks (default: vLLM's choice)",
        label="vLLM chunked prefill",
        passthrough=True,
    ),
    Setting(
        "max_num_batched_tokens",
        int,
        None,
        "vllm",
        "tokens per engine step (default: vLLM's)",
        label="vLLM max_num_batched_tokens",
        passthrough=True,
        minimum=1,
    ),
    Setting(
        "max_num_seqs",
        int,
        None,
        "vllm",
        "sequences per engine step (default: vLLM's)",
        label="vLLM max_num_seqs",
        passthrough=True,
        minimum=1,
    ),
    Setting(
        "gpu_memory_utilization",
        float,
        None,
        "vllm",
        "share of the device vLLM may take (default: sized from the model's files; docs/team.md, Memory policy)",
        label="vLLM gpu_memory_utilization",
        minimum=0.0,
        maximum=1.0,
    ),
    Setting("seed", int, 0, "vllm", "vLLM's random seed", label="vLLM seed", passthrough=True, minimum=0),
    Setting(
        "attention_backend",
        str,
        None,
        "vllm",
        "vLLM attention backend; FLEX_ATTENTION matched HF to 3e-5 in float32 on an H200; the CPU build has CPU_ATTN only",
        label="vLLM attention_backend",
        passthrough=True,
        choices=ATTENTION_BACKENDS,
    ),
    Setting(
        "tensor_parallel_size",
        int,
        None,
        "vllm",
        "vLLM tensor-parallel GPUs (default: the fewest that hold the model)",
        label="vLLM tensor_parallel_size",
        passthrough=True,
        minimum=1,
    ),
    Setting(
        "pipeline_parallel_size",
        int,
        None,
        "vllm",
        "vLLM pipeline stages (default 1)",
        label="vLLM pipeline_parallel_size",
        passthrough=True,
        minimum=1,
    ),
    Setting(
        "distributed_executor_backend",
        str,
        None,
        "vllm",
        "vLLM's executor: ray runs across a Ray cluster's GPUs (default: vLLM's choice)",
        label="vLLM executor",
        passthrough=True,
        choices=("mp", "ray"),
    ),
    Setting(
        "batch_invariant",
        bool,
        False,
        "vllm",
        "vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1 in that engine's environment): a sequence scores the "
        "same alone or in any batch; NVIDIA GPUs only",
        label="vLLM batch-invariant mode",
    ),
    Setting(
        "quantization",
        str,
        None,
        "vllm",
        "serve quantized: fp8 weights (vLLM quantizes at load); HF stays the unquantized reference",
        label="vLLM quantization",
        passthrough=True,
        choices=("fp8",),
    ),
    Setting(
        "kv_cache_dtype",
        str,
        None,
        "vllm",
        "vLLM's KV-cache dtype: fp8 stores keys and values in 8 bits (default: the model's dtype)",
        label="vLLM kv_cache_dtype",
        passthrough=True,
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    ),
    # HF
    Setting(
        "attn_implementation",
        str,
        None,
        "hf",
        "HF attention implementation (default: transformers' choice, sdpa)",
        label="HF attn_implementation",
        passthrough=True,
        choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
    ),
    Setting(
        "hf_batch_size",
        int,
        1,
        "hf",
        "HF sequences per forward pass (1: no padding, no batch effects; more is faster and adds batch effects)",
        label="HF batch size",
        minimum=1,
    ),
    Setting(
        "hf_device_map",
        str,
        None,
        "hf",
        "spread the HF model over the GPUs with accelerate (default: when it does not fit one)",
        label="HF device_map",
        choices=("auto",),
    ),
    Setting(
        "hf_cudnn_attention",
        bool,
        None,
        "hf",
        "let HF's SDPA use cuDNN attention (default: off for rollouts and rescoring on a GPU, torch's choice elsewhere, "
        "which is on for Hopper GPUs); off skips cuDNN's planning of each new batch shape (measured on the H200: "
        "most of a rollout's HF time) at the price of another attention kernel",
        label="HF cuDNN attention",
    ),
    Setting(
        "hf_compile",
        bool,
        False,
        "hf",
        "torch.compile HF's forward and logprob blocks: faster on many prompts, the first call compiles, bfloat16 numerics move",
        label="HF torch.compile",
    ),
    # both
    Setting(
        "tf32",
        bool,
        False,
        "both",
        "TF32 matmuls for float32 on NVIDIA GPUs (torch.backends.cuda.matmul.allow_tf32) in that engine's process",
        label="TF32 matmuls",
    ),
    Setting(
        "device_memory",
        str,
        None,
        "both",
        "the most memory the engines may take on the device, e.g. 80GB: where vLLM and HF do not fit together "
        "under it, they run in turn (docs/guides/big-models.md); on a CPU it caps the RAM they take (default: the device's)",
        label="Device memory cap (changes no number, so not in the run id)",
        in_run_id=False,
        parse=parse_size,
    ),
    Setting(
        "trust_remote_code",
        bool,
        False,
        "both",
        "run the model's own Python code (off unless you trust its authors)",
        label="trust_remote_code",
        passthrough=True,
    ),
)


def settings_class(registry: tuple[Setting, ...]) -> type:
    """A frozen dataclass with one field per setting, and the helpers every consumer uses."""
    fields = [(s.name, Any, dataclasses.field(default=s.default)) for s in registry]
    ns = {
        "__doc__": "Engine knobs that can move a logprob (see logprob_parity.inputs.settings.SETTINGS). None: the engine's default.",
        "REGISTRY": registry,
        "to_dict": dataclasses.asdict,
        "run_id_part": lambda self: _values(self, lambda s: s.in_run_id),
        "vllm_part": lambda self: _values(self, lambda s: s.backend in ("vllm", "both")),
        "hf_part": lambda self: _values(self, lambda s: s.backend in ("hf", "both")),
        "passthrough": lambda self, backend: {
            k: v for k, v in _values(self, lambda s: s.passthrough and s.backend in (backend, "both")).items() if v is not None
        },
        "validate": _validate,
        "from_dict": classmethod(_from_dict),
    }
    return dataclasses.make_dataclass("EngineSettings", fields, namespace=ns, frozen=True)


def _values(self: Any, keep: Any) -> dict[str, Any]:
    """{name: value} of the registered settings that `keep(setting)` selects."""
    return {s.name: getattr(self, s.name) for s in self.REGISTRY if keep(s)}


def _validate(self: Any) -> None:
    for s in self.REGISTRY:
        s.check(getattr(self, s.name))


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Settings stored by any version: unknown names are refused, missing ones take their default
    (a setting added later did not exist, so the run used the engine's behaviour it now defaults to)."""
    names = {s.name for s in cls.REGISTRY}
    unknown = set(data) - names
    if unknown:
        raise UserError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
    return cls(**data)


EngineSettings = settings_class(SETTINGS)
# Pickled across the host channel: give the generated class its real import path.
EngineSettings.__module__ = __name__
EngineSettings.__qualname__ = "EngineSettings"
