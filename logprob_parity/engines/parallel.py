"""Tensor and pipeline parallelism (vLLM) and the device map (HF), chosen from the model's size and the
GPUs present, then written into the settings so the run id records what actually ran."""

from __future__ import annotations

import dataclasses

from logprob_parity.engines import memory
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import EngineSettings

# Weights may take at most this share of one card; the rest is KV cache, activations and logits.
WEIGHT_SHARE = 0.7
TP_SIZES = (1, 2, 4, 8)


def resolve(
    settings: EngineSettings, model_path: str, dtype: str, device: str, cards: list[memory.GPU] | None = None
) -> EngineSettings:
    """Settings with tensor_parallel_size, pipeline_parallel_size and hf_device_map made concrete.

    Chosen from total (not free) memory, so the same request always gets the same plan and run id.
    """
    tp, pp, dmap = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.hf_device_map
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"{name} must be a positive integer (got {value})")
    if dmap not in (None, "auto"):
        raise UserError(f"hf_device_map must be 'auto' or unset (got {dmap!r})")
    ray = settings.distributed_executor_backend == "ray"
    if settings.distributed_executor_backend not in (None, "mp", "ray"):
        raise UserError(f"distributed_executor_backend must be mp or ray (got {settings.distributed_executor_backend!r})")
    if device != "cuda":
        if (tp or 1) > 1 or (pp or 1) > 1 or dmap:
            raise UserError("tensor/pipeline parallelism and hf_device_map='auto' need GPUs; this run is on the CPU")
        return dataclasses.replace(settings, tensor_parallel_size=1, pipeline_parallel_size=1)
    cards = memory.gpu_cards() if cards is None else cards
    n = max(len(cards), 1)
    if (tp or 1) * (pp or 1) > n and not ray:  # a Ray cluster may hold more GPUs than this machine
        raise UserError(
            f"tensor_parallel_size x pipeline_parallel_size = {(tp or 1) * (pp or 1)}, "
            f"but {n} GPU(s) are visible here (use distributed_executor_backend=ray for a cluster)"
        )
    per_card = min((c.total for c in cards), default=0)
    weights = memory.weight_bytes(model_path, dtype)
    pp = pp or 1
    if tp is None:
        heads = memory.text_config(model_path, settings.trust_remote_code).num_attention_heads
        fits = [
            t
            for t in TP_SIZES
            if t * pp <= n and heads % t == 0 and (not per_card or weights / (t * pp) <= WEIGHT_SHARE * per_card)
        ]
        if not fits:
            raise UserError(
                f"{dtype} weights take {weights / memory.GIB:.1f} GiB; {n} GPU(s) of {per_card / memory.GIB:.0f} GiB "
                f"cannot hold them with room for the KV cache (choose tensor/pipeline parallel sizes, or a smaller dtype)"
            )
        tp = fits[0]
    if dmap is None and per_card and n > 1 and weights > WEIGHT_SHARE * per_card:
        dmap = "auto"
    return dataclasses.replace(settings, tensor_parallel_size=tp, pipeline_parallel_size=pp, hf_device_map=dmap)
