"""Each decoder layer's residual stream and its attention and MLP blocks' outputs, on either engine,
kept where the forward computes them and compared there.

Why there: a long text on a big model has a stack of hidden states larger than host memory wants to
hold (the 8B shape: 32 layers x 3 blocks x 2,048 tokens x 4,096 floats is 3.2 GB), and writing it out
and reading it back cost more than the forwards (an H100 spent 2 s of a 5 s part on it). So:
- one capture is *kept* as a stack, [layers, blocks, tokens, hidden] float32, on the engine's device:
  vLLM's, shared with the HF host the way the exact KL's rows are (CUDA IPC on a GPU, a shared-memory
  file on the CPU), and HF's own, text alone;
- every other capture is *compared* as it is computed: each hook turns its rows into relative errors
  against the kept stacks' same rows and drops them (a `Sink`).
The comparisons leave [layers, blocks, tokens] float64 arrays; nothing else leaves the HF host.

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

The float64 reference (`float64_layers`) is HF's own model run one layer at a time in float64: each
decoder layer gets float64 copies of its weights just before its forward and its own tensors back
just after (the same memory, so the engine repeats its results bit for bit after), with eager
attention and eager experts. Exact arithmetic on
the weights both engines load, without a second copy of the model: 8B in float64 is 64 GB, one layer
of it 1.7 GB.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

BLOCKS = ("attn", "mlp", "resid")  # in the order they are computed within a layer
ATTN_NAMES = ("self_attn", "attn", "attention")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "fc2")
_STATE: dict[str, Any] = {"sink": None, "select": None, "reference": False}
_KEPT: dict[str, Any] = {}  # token -> a kept stack, until `release`


class StopForward(Exception):
    """Raised by the last decoder layer's hook: nothing after it (final norm, LM head) is needed."""


def relative_error(a: Any, b: Any) -> Any:
    """‖a − b‖ / ‖b‖ per row of two [tokens, hidden] tensors, in float64; 0 where both rows are 0,
    inf where only b's is."""
    import torch

    a64, b64 = a.to(torch.float64), b.to(device=a.device, dtype=torch.float64)
    num = torch.linalg.vector_norm(a64 - b64, dim=1)
    den = torch.linalg.vector_norm(b64, dim=1)
    inf, zero = torch.full_like(num, float("inf")), torch.zeros_like(num)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.where(num > 0, inf, zero))


class Sink:
    """Where one capture's rows go, piece by piece in token order (a text prefilled in several forwards
    arrives in several pieces): kept in a stack (`keep`), and/or compared against earlier captures'
    stacks. against: (name, stack, this_is_b): the relative error of the stack's rows against these
    (this_is_b) or of these against the stack's."""

    def __init__(
        self, n_layers: int, n_tokens: int, keep: bool = False, against: tuple[tuple[str, Any, bool], ...] = (), dtype: Any = None
    ):
        import torch

        self.n_layers, self.n_tokens, self.keep, self.against = n_layers, n_tokens, keep, against
        self.dtype = dtype or torch.float32  # the kept stack's
        self.stack: Any = None
        self.errors: dict[str, Any] = {name: None for name, _, _ in against}
        self.at: dict[tuple[int, int], int] = {}
        self.pieces = 0
        self.dtypes: set[Any] = set()
        self._torch = torch

    def put(self, block: str, layer: int, rows: Any) -> None:
        torch = self._torch
        b = BLOCKS.index(block)
        lo = self.at.get((layer, b), 0)
        hi = min(lo + rows.shape[0], self.n_tokens)
        rows = rows[: hi - lo]
        self.at[(layer, b)] = hi
        self.pieces += 1
        self.dtypes.add(rows.dtype)
        if self.keep:
            if self.stack is None:
                self.stack = torch.zeros(
                    (self.n_layers, len(BLOCKS), self.n_tokens, rows.shape[-1]), dtype=self.dtype, device=rows.device
                )
            self.stack[layer, b, lo:hi] = rows
        for name, other, this_is_b in self.against:
            if self.errors[name] is None:
                self.errors[name] = torch.zeros(
                    (self.n_layers, len(BLOCKS), self.n_tokens), dtype=torch.float64, device=rows.device
                )
            theirs = other[layer, b, lo:hi]
            self.errors[name][layer, b, lo:hi] = (
                relative_error(theirs, rows) if this_is_b else relative_error(rows, theirs.to(rows.device))
            )

    def missing(self) -> list[str]:
        """The (layer, block)s that did not receive every token: a capture that ran short."""
        return [
            f"layer {layer}'s {block}"
            for layer in range(self.n_layers)
            for b, block in enumerate(BLOCKS)
            if self.at.get((layer, b), 0) < self.n_tokens
        ]

    def arrays(self) -> dict[str, Any]:
        """Each comparison's [layers, blocks, tokens] float64, on the host."""
        return {name: e.cpu().numpy() for name, e in self.errors.items() if e is not None}


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
    sink: Sink | None = _STATE["sink"]
    if sink is None:
        return
    select: Callable[[Any], Any] | None = _STATE["select"]
    t = tensor.detach() if select is None else select(tensor.detach())
    sink.put(block, layer, t.reshape(-1, t.shape[-1]))


def _stop(m: Any, a: Any, out: Any) -> None:
    if _STATE["sink"] is not None:
        raise StopForward


def install_hooks(model: Any, stop: bool = False) -> int:
    """Forward hooks on every decoder layer and its two blocks, until `remove_hooks`; the layer count.
    stop: the last layer's hook ends the forward (StopForward), so no final norm or LM head runs.
    They stay only for one capture: a hook left on a model that `hf_compile` compiles would break its
    graph at every layer of every later forward."""
    layers = decoder_layers(model)
    remove_hooks(model)
    handles = []
    for i, layer in enumerate(layers):
        handles.append(_child(layer, ATTN_NAMES).register_forward_hook(lambda m, a, out, i=i: _save("attn", i, _first(out))))
        handles.append(_child(layer, MLP_NAMES).register_forward_hook(lambda m, a, out, i=i: _save("mlp", i, _first(out))))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: _save("resid", i, _stream(out))))
    if stop and layers:
        handles.append(layers[-1].register_forward_hook(_stop))
    model._lpp_layer_hooks = handles
    return len(layers)


def remove_hooks(model: Any) -> None:
    for h in getattr(model, "_lpp_layer_hooks", None) or []:
        h.remove()
    model._lpp_layer_hooks = []


def begin(sink: Sink, select: Callable[[Any], Any] | None = None) -> None:
    """Send every hooked tensor to `sink` until `end`. select: picks a text's rows from an HF batch's
    [batch, tokens, hidden] tensor (None: every row, as vLLM's flat [tokens, hidden])."""
    _STATE.update(sink=sink, select=select)


def end(model: Any = None) -> Sink | None:
    """Stop sending and take the hooks off `model`; the sink that was filled."""
    if model is not None:
        remove_hooks(model)
    sink = _STATE["sink"]
    _STATE.update(sink=None, select=None)
    return sink


@contextlib.contextmanager
def capturing(model: Any, sink: Sink, select: Callable[[Any], Any] | None = None, stop: bool = False) -> Iterator[Sink]:
    """Hooks on, rows to `sink`, hooks off after; a StopForward from the last layer ends the forward quietly."""
    install_hooks(model, stop=stop)
    begin(sink, select)
    try:
        yield sink
    except StopForward:
        pass
    finally:
        end(model)


# --- a kept stack, shared with another process (as logprob_parity.engines.fullvocab shares rows) ---


def keep(stack: Any) -> str:
    """Hold `stack` until `release(token)`; the token."""
    token = uuid.uuid4().hex
    _KEPT[token] = stack
    return token


def share(token: str) -> tuple[str, Any]:
    """A handle to a kept stack that another process opens (`open_stack`), as the exact KL's rows are
    shared (fullvocab.handle_of): CUDA IPC on a GPU, a shared-memory file on the CPU."""
    from logprob_parity.engines.fullvocab import handle_of

    return handle_of(_KEPT[token])


def open_stack(handle: tuple[str, Any]) -> Any:
    from logprob_parity.engines.fullvocab import open_handle

    return open_handle(handle)


def release(token: str) -> bool:
    t = _KEPT.pop(token, None)
    if t is not None and t.is_cuda:
        import torch

        del t
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        return True
    return t is not None


# --- the float64 reference, one layer at a time ---


def _set_impl(model: Any, kind: str, value: Any) -> Any:
    """Switch the model's attention or experts implementation ("attn", "experts"); the one before, or
    None where the model has no such switch."""
    config = getattr(model, "config", None)
    before = getattr(config, f"_{kind}_implementation", None)
    setter = getattr(model, f"set_{kind}_implementation", None)
    if before is None or setter is None or before == value:
        return None
    try:
        setter(value)
    except (ValueError, AttributeError, NotImplementedError):
        return None
    return before


def _cast(module: Any, dtype: Any) -> dict[str, Any]:
    """Give a module's floating parameters and buffers a `dtype` copy in place of their data; their own
    tensors, by name, for `_uncast` to put back."""
    import itertools

    import torch

    was: dict[str, Any] = {}
    with torch.inference_mode(False), torch.no_grad():
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                was[name] = t.data
                t.data = t.data.to(dtype)
    return was


def _uncast(module: Any, was: dict[str, Any]) -> None:
    """Put back the very tensors `_cast` set aside: the same values, and the same memory. A copy cast
    back would hold the same values at another address, and MKL's small matmuls (HF's one token a
    forward through its KV cache) sum in an order that follows the address: the engine would no longer
    repeat its own earlier results bit for bit."""
    import itertools

    import torch

    with torch.inference_mode(False), torch.no_grad():
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            if name in was:
                t.data = was[name]


@contextlib.contextmanager
def float64_layers(model: Any) -> Iterator[None]:
    """While open, each decoder layer runs in float64 (cast up by a pre-hook, back by a hook), with eager
    attention and eager experts (grouped_mm has no float64); planted faults (`perturb_module`) are off,
    since the reference is the model's definition, not the engine. The caller feeds float64 embeddings
    (`float64_embeddings`)."""
    import torch

    layers = decoder_layers(model)
    attn, experts = _set_impl(model, "attn", "eager"), _set_impl(model, "experts", "eager")
    was: dict[int, dict[str, Any]] = {}

    def up(m: Any, args: Any) -> None:
        was[id(m)] = _cast(m, torch.float64)

    def down(m: Any, args: Any, out: Any) -> None:
        _uncast(m, was.pop(id(m), {}))

    handles = [
        h
        for layer in layers
        for h in (layer.register_forward_pre_hook(up, prepend=True), layer.register_forward_hook(down, prepend=True))
    ]
    _STATE["reference"] = True
    try:
        yield
    finally:
        _STATE["reference"] = False
        for h in handles:
            h.remove()
        for layer in layers:  # a forward that failed inside a layer left it cast up
            if id(layer) in was:
                _uncast(layer, was.pop(id(layer)))
        if attn is not None:
            model.set_attn_implementation(attn)
        if experts is not None:
            model.set_experts_implementation(experts)


def float64_embeddings(model: Any, x: Any) -> Any:
    """The input embeddings of ids `x` in float64: the embedding module cast up for the lookup (its
    scale, where the family folds one in, computed in float64) and back."""
    import torch

    emb = model.get_input_embeddings()
    was = _cast(emb, torch.float64)
    try:
        return emb(x)
    finally:
        _uncast(emb, was)


# --- vLLM: run in the engine core's worker through LLM.collective_rpc (in-process) ---


def vllm_install(worker: Any) -> int:
    return install_hooks(worker.model_runner.model)


def vllm_begin(worker: Any, n_layers: int, n_tokens: int) -> None:
    begin(Sink(n_layers, n_tokens, keep=True))


def vllm_end(worker: Any) -> dict[str, Any]:
    """The capture's token (its stack kept, `share`) and what it received."""
    sink = end(worker.model_runner.model)
    if sink is None or sink.stack is None:
        return {"token": None, "pieces": 0, "missing": ["every layer"]}
    return {"token": keep(sink.stack), "pieces": sink.pieces, "missing": sink.missing()}


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
    capture reads the perturbed output, as it would a fault in the weights; the float64 reference
    (float64_layers) runs without it, as it would run from the checkpoint."""
    module = block_module(model, layer, block)

    def scale(m: Any, args: Any, out: Any) -> Any:
        if _STATE["reference"]:
            return None
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
