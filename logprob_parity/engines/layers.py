"""Each decoder layer's residual stream and its attention and MLP blocks' outputs, on either engine,
written as they are computed to a folder of float32 `.npy` pieces.

Why a folder: a long text on a big model has a stack of hidden states larger than host memory can
hold at once (the 8B shape: 32 layers x 3 tensors x 2,048 tokens x 4,096 floats is 3.2 GB). Each
forward hook writes its piece and drops it; the analysis (logprob_parity.analysis.layers) then reads
one (block, layer) at a time from both sides, memory-mapped.

What each block means, the same on both engines:
- `attn`: what the attention module returns (its output projection's result), before any residual
  add or post-norm the layer applies to it;
- `mlp`: what the MLP (or MoE) module returns, likewise (OPT, whose layer holds fc1 and fc2 itself:
  fc2's output);
- `resid`: the residual stream after the layer. vLLM keeps it apart: its layers return
  `(hidden_states, residual)` and fuse the add into the next layer's norm, so the stream is their
  sum (nnsight met the same, ndif-team/nnsight#630). A layer returning one tensor returns the stream.

vLLM runs this through `collective_rpc` on the engine core in our host's process (as the router
capture of logprob_parity.engines.routing does); Python must run at every forward, so the engine
must be eager (the project's default, `enforce_eager`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BLOCKS = ("attn", "mlp", "resid")  # in the order they are computed within a layer
ATTN_NAMES = ("self_attn", "attn", "attention")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "fc2")
_STATE: dict[str, Any] = {"folder": None, "pieces": {}, "select": None}


def _child(layer: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        m = getattr(layer, name, None)
        if m is not None and hasattr(m, "forward"):
            return m
    return None


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers in order: the longest ModuleList whose items each hold an
    attention module and an MLP (HF's `model.layers`, GPT-2's `transformer.h`, vLLM's the same)."""
    import torch

    best: list[Any] = []
    for m in model.modules():
        if (
            isinstance(m, torch.nn.ModuleList)
            and len(m) > len(best)
            and all(_child(x, ATTN_NAMES) is not None and _child(x, MLP_NAMES) is not None for x in m)
        ):
            best = list(m)
    return best


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _stream(out: Any) -> Any:
    """The residual stream a layer's output stands for: vLLM's (hidden_states, residual) summed."""
    if isinstance(out, (tuple, list)):
        if len(out) >= 2 and out[1] is not None and hasattr(out[1], "shape") and out[1].shape == out[0].shape:
            return out[0] + out[1]
        return out[0]
    return out


def _save(block: str, layer: int, tensor: Any) -> None:
    folder = _STATE["folder"]
    if folder is None:
        return
    select: Callable[[Any], Any] | None = _STATE["select"]
    t = tensor if select is None else select(tensor)
    rows = t.detach().float().reshape(-1, t.shape[-1]).cpu().numpy()
    key = (block, layer)
    k = _STATE["pieces"].get(key, 0)
    _STATE["pieces"][key] = k + 1
    np.save(Path(folder) / f"{block}.{layer:04d}.{k:04d}.npy", rows)


def install_hooks(model: Any) -> int:
    """Forward hooks on every decoder layer and its two blocks, until `remove_hooks`; the layer count.
    They stay only for one capture: a hook left on a model that `hf_compile` compiles would break its
    graph at every layer of every later forward."""
    layers = decoder_layers(model)
    remove_hooks(model)
    handles = []
    for i, layer in enumerate(layers):
        handles.append(_child(layer, ATTN_NAMES).register_forward_hook(lambda m, a, out, i=i: _save("attn", i, _first(out))))
        handles.append(_child(layer, MLP_NAMES).register_forward_hook(lambda m, a, out, i=i: _save("mlp", i, _first(out))))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: _save("resid", i, _stream(out))))
    model._lpp_layer_hooks = handles
    return len(layers)


def remove_hooks(model: Any) -> None:
    for h in getattr(model, "_lpp_layer_hooks", None) or []:
        h.remove()
    model._lpp_layer_hooks = []


def begin(folder: str, select: Callable[[Any], Any] | None = None) -> None:
    """Write every hooked tensor to `folder` until `end`. select: picks a text's rows from an HF
    batch's [batch, tokens, hidden] tensor (None: every row, as vLLM's flat [tokens, hidden])."""
    os.makedirs(folder, exist_ok=True)
    _STATE.update(folder=folder, pieces={}, select=select)


def end(model: Any = None) -> dict[str, int]:
    """Stop writing and take the hooks off `model`; how many pieces each block wrote, summed over layers."""
    if model is not None:
        remove_hooks(model)
    pieces = _STATE["pieces"]
    _STATE.update(folder=None, pieces={}, select=None)
    counts: dict[str, int] = {}
    for (block, _layer), n in pieces.items():
        counts[block] = counts.get(block, 0) + n
    return counts


def read(folder: str, block: str, layer: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, hidden] float32 of one block of one layer: its pieces in the order they were written
    (a text prefilled in several forwards), the first n_tokens rows."""
    parts = sorted(Path(folder).glob(f"{block}.{layer:04d}.*.npy"))
    if not parts:
        raise FileNotFoundError(f"no {block} rows of layer {layer} in {folder}")
    rows = np.concatenate([np.load(p, mmap_mode="r") for p in parts]) if len(parts) > 1 else np.load(parts[0], mmap_mode="r")
    if len(rows) < n_tokens:
        raise ValueError(f"{block} of layer {layer}: {len(rows)} rows for a text of {n_tokens} tokens")
    return np.asarray(rows[:n_tokens], dtype=np.float32)


# --- vLLM: run in the engine core's worker through LLM.collective_rpc (in-process) ---


def vllm_install(worker: Any) -> int:
    return install_hooks(worker.model_runner.model)


def vllm_begin(worker: Any, folder: str) -> None:
    begin(folder)


def vllm_end(worker: Any) -> dict[str, int]:
    return end(worker.model_runner.model)


def block_module_of(layer: Any) -> Any:
    """A decoder layer's MLP (or MoE) module."""
    return _child(layer, MLP_NAMES)


def block_module(model: Any, layer: int, block: str) -> Any:
    """The module of one block of one layer (attn, mlp), or the whole layer (resid)."""
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer {layer} is not one of the model's {len(layers)} layers")
    if block == "resid":
        return layers[layer]
    return _child(layers[layer], ATTN_NAMES if block == "attn" else MLP_NAMES)


def perturb_module(model: Any, layer: int, block: str, factor: float) -> int:
    """Scale one block's output of one layer by `factor` until `restore_module`: what scaling the
    block's output projection's weights does (a planted fault, for tests). A hook and not the weights
    themselves, because vLLM's CPU linears pack their weights for oneDNN when the model loads: a change
    to the parameter afterwards never reaches the kernel. It runs before the capture's hooks, so the
    capture reads the perturbed output, as it would a fault in the weights."""
    module = block_module(model, layer, block)

    def scale(m: Any, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (out[0] * factor, *out[1:]) if block != "resid" else tuple(o * factor if o is not None else o for o in out)
        return out * factor

    handles = getattr(model, "_lpp_perturbed", None)
    if handles is None:
        handles = model._lpp_perturbed = []
    handles.append(module.register_forward_hook(scale, prepend=True))
    return len(handles)


def restore_module(model: Any) -> int:
    handles = getattr(model, "_lpp_perturbed", None) or []
    for h in handles:
        h.remove()
    model._lpp_perturbed = []
    return len(handles)


def vllm_perturb(worker: Any, layer: int, block: str, factor: float) -> int:
    return perturb_module(worker.model_runner.model, layer, block, factor)


def vllm_restore(worker: Any) -> int:
    return restore_module(worker.model_runner.model)
