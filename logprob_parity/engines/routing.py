"""Which experts each MoE layer picked for each token, on each side, and where the two differ.

Why: in a mixture of experts, a token whose router picks another expert set in vLLM than in HF is
computed by other weights; routing flips are the largest source of mismatch RL teams see between
engine and trainer (arXiv 2510.11370, "R3"). Routes are compared as sets, since engines return the
ids in no fixed order (vLLM's CPU router returns its top-k unsorted).

vLLM's side, two ways that read the same ids (a GPU test holds them equal):
- `own_routes`: vLLM's own `enable_return_routed_experts`, which the vLLM backend turns on for an
  MoE model on a GPU. It is bound before CUDA graphs are captured, so it sees every forward.
- `captured_routes`: a capture function on every MoE router of our in-process engine core
  (`BaseRouter.set_capture_fn`, the hook vLLM's own option uses), bound through `collective_rpc`,
  each sequence prefilled alone so the captured rows are its tokens in order. Python must run at each
  forward, so this is for an eager engine: the CPU (where vLLM's own option needs Model Runner V2,
  which is not installed) or a GPU engine with `enforce_eager`. A capture already bound (vLLM's own)
  is kept and called first.
HF's side: each MoE layer's router logits (`output_router_logits=True`), top-k by logit, the
selection softmax-then-top-k makes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

NOT_MOE = "not an MoE model"
_STATE: dict[str, Any] = {"on": False, "got": {}}


def install(worker: Any) -> int:
    """Bind the capture to every MoE router of this worker's model (once); the number of MoE layers
    (0: a dense model). Run through LLM.collective_rpc, in-process."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    n = 0
    for module in worker.model_runner.model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            if not getattr(module.router, "_lpp_routes", False):
                before = getattr(module.router, "capture_fn", None)
                module.router.set_capture_fn(partial(_capture, int(module.layer_id), before, worker.model_runner))
                module.router._lpp_routes = True
            n += 1
    return n


def _capture(layer: int, before: Any, runner: Any, topk_ids: Any) -> None:
    if before is not None:
        before(topk_ids)
    if not _STATE["on"]:
        return
    rows = topk_ids.detach().to("cpu").numpy().astype(np.int64)
    if not _STATE.get("split"):
        _STATE["got"].setdefault(layer, []).append(rows)
        return
    # a batch of requests (a rollout decoding together): cut the rows by request, as the model
    # runner laid them out for this forward (its request order and query_start_loc)
    n = int(runner.input_batch.num_reqs)
    ids = list(runner.input_batch.req_ids[:n])
    bounds = np.asarray(runner.query_start_loc.np[: n + 1]).copy()
    if int(bounds[-1]) != len(rows):
        _STATE["unsplit"] = f"a forward of {len(rows)} router rows for {int(bounds[-1])} scheduled tokens"
        return
    for j, rid in enumerate(ids):
        if rid not in _STATE["order"]:
            _STATE["order"].append(rid)
        _STATE["by_req"].setdefault(rid, {}).setdefault(layer, []).append(rows[bounds[j] : bounds[j + 1]])


def begin(worker: Any) -> None:
    _STATE["got"], _STATE["on"], _STATE["split"] = {}, True, False


def begin_split(worker: Any) -> None:
    """Capture a batched generate's forwards request by request (take_split)."""
    _STATE.update(on=True, split=True, order=[], by_req={}, unsplit=None)


def take_split(worker: Any) -> list[dict[int, np.ndarray]] | str:
    """Each request's rows per layer, requests in the order they first ran (the order they were
    submitted: vLLM schedules first come, first served); a sentence when a forward could not be cut."""
    _STATE.update(on=False, split=False)
    if _STATE.get("unsplit"):
        return f"vLLM's router capture could not tell the requests apart ({_STATE['unsplit']})"
    out = [{layer: np.concatenate(parts) for layer, parts in _STATE["by_req"][rid].items()} for rid in _STATE["order"]]
    _STATE.update(order=[], by_req={})
    return out


def take(worker: Any) -> dict[int, np.ndarray]:
    """Each layer's captured rows since `begin`, in token order (every forward of the request)."""
    _STATE["on"] = False
    got, _STATE["got"] = _STATE["got"], {}
    return {layer: np.concatenate(parts) for layer, parts in got.items()}


VLLM_OWN = "vLLM's own enable_return_routed_experts (CompletionOutput.routed_experts)"
VLLM_CAPTURE = "a capture on each MoE router of the engine (BaseRouter.set_capture_fn), each text prefilled alone"


def vllm_source(llm: Any) -> str | None:
    """Which way this engine's routes are read (VLLM_OWN or VLLM_CAPTURE), or a sentence starting
    with "no:" when neither works: an engine with CUDA graphs and without vLLM's own option, whose
    graphs replay without running the capture."""
    m = llm.llm_engine.vllm_config.model_config
    if getattr(m, "enable_return_routed_experts", False):
        return VLLM_OWN
    if m.enforce_eager or str(getattr(llm.llm_engine.vllm_config.device_config, "device_type", "cpu")) == "cpu":
        return VLLM_CAPTURE
    return (
        "no: this engine replays CUDA graphs, where a router capture does not run, and was started without "
        "enable_return_routed_experts"
    )


def own_routes(llm: Any, sequences: list[list[int]]) -> list[np.ndarray]:
    """[tokens, MoE layers, k] per sequence from vLLM's own routed experts (prompt tokens first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences], params, use_tqdm=False)
    return [np.asarray(o.outputs[0].routed_experts)[: len(ids)].astype(np.int64) for ids, o in zip(sequences, outs)]


def captured_routes(llm: Any, sequences: list[list[int]]) -> list[np.ndarray] | str:
    """[tokens, MoE layers, k] per sequence from the capture on each router (install), each sequence
    prefilled alone; a sentence when the model has no router the capture reaches."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not llm.collective_rpc(install)[0]:
        return "vLLM's model has no MoE router the capture reaches"
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    out = []
    for ids in sequences:
        # a prefix-cached block is not computed again, so its routers would not run: start cold (on
        # a GPU prefix caching is on by default; the H200 showed 14 of 30 rows after one earlier pass)
        llm.reset_prefix_cache()
        llm.collective_rpc(begin)
        try:
            llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        finally:
            got = llm.collective_rpc(take)[0]
        if not got:
            return "vLLM's router capture saw no forward (an engine whose CUDA graphs replay without it)"
        short = min(len(rows) for rows in got.values())
        if short < len(ids):
            return f"vLLM's router capture saw {short} of a text's {len(ids)} tokens"
        out.append(stacked(got, len(ids)))
    return out


def stacked(by_layer: dict[int, np.ndarray], n_tokens: int) -> np.ndarray:
    """[tokens, layers, k] from per-layer rows: the first n_tokens rows (the prompt's prefill; a
    decode step after it adds rows that are not the prompt's), layers in their model order."""
    return np.stack([by_layer[k][:n_tokens] for k in sorted(by_layer)], axis=1)


def compare_routes(vllm: np.ndarray, hf: np.ndarray) -> dict[str, Any]:
    """One sequence's routes on both sides ([tokens, layers, k] each) compared as sets per (token,
    layer): `flipped` the number of layers whose sets differ at each token (routes are per token, so
    `flipped[t]` is token t's own routing, position-aligned with the token ids), `flips` one
    [token, layer, vLLM ids, HF ids] for each (token, layer) that differs (JSON-safe: no int keys)."""
    v, h = np.sort(vllm, axis=-1), np.sort(hf, axis=-1)
    differ = (v != h).any(axis=-1)  # [tokens, layers]
    flips = [[int(t), int(layer), v[t, layer].tolist(), h[t, layer].tolist()] for t, layer in zip(*np.nonzero(differ))]
    return {"flipped": differ.sum(axis=1).astype(int).tolist(), "layers": int(differ.shape[1]), "flips": flips}


def flips_at(routing: dict[str, Any] | None, t: int) -> list[tuple[int, list[int], list[int]]]:
    """(layer, vLLM ids, HF ids) of each layer that routed token t differently."""
    return [(f[1], f[2], f[3]) for f in (routing or {}).get("flips", ()) if f[0] == t]


def routing_summary(per_seq: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's routing keys over the sequences measured: routing_flip_frac (the share of (token,
    layer) routers whose sets differ), routing_tokens_flipped (the share of tokens with at least one
    layer that differs), routing_layers_flipped_mean (layers that differ, per token)."""
    flipped = np.concatenate([np.asarray(s["flipped"], dtype=np.float64) for s in per_seq]) if per_seq else np.zeros(0)
    layers = per_seq[0]["layers"] if per_seq else 0
    if flipped.size == 0 or layers == 0:
        return {"routing_flip_frac": None, "routing_tokens_flipped": None, "routing_layers_flipped_mean": None}
    return {
        "routing_flip_frac": float(flipped.sum() / (flipped.size * layers)),
        "routing_tokens_flipped": float((flipped > 0).mean()),
        "routing_layers_flipped_mean": float(flipped.mean()),
    }


def hf_routes(model: Any, ids: list[int], device: str) -> np.ndarray | None:
    """HF's expert ids for one sequence, [tokens, MoE layers, k], from each MoE layer's router logits
    (top-k by logit); None for a dense model."""
    import torch

    k = getattr(model.config, "num_experts_per_tok", None)
    if not k:
        return None
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=x, output_router_logits=True, use_cache=False).router_logits
    if not logits:
        return None
    rows = [lg.reshape(len(ids), -1).float().topk(int(k), dim=-1).indices.cpu().numpy() for lg in logits]
    return np.stack(rows, axis=1).astype(np.int64)


def moe_gates(model: Any) -> list[Any]:
    """HF's MoE routers in model order (a block with `gate` and `experts`; the gate returns
    (router_logits, routing_weights, selected_experts), as transformers 5's MoE families do)."""
    return [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


class Replay:
    """HF's MoE routers forced to given expert ids while in this context: R3's rule (arXiv
    2510.11370), the selection replayed and its weights recomputed from HF's own router logits
    (softmax, the forced experts' probabilities, renormalised where the family renormalises).
    `routes`: [tokens, MoE layers, k] for the one sequence scored inside. `chosen` keeps, per layer,
    the ids the routers returned, so a test can see the replay took."""

    def __init__(self, model: Any, routes: np.ndarray) -> None:
        self.gates = moe_gates(model)
        if len(self.gates) != routes.shape[1]:
            raise ValueError(f"{len(self.gates)} MoE layers in HF's model, {routes.shape[1]} in the routes")
        self.routes = routes
        self.chosen: list[np.ndarray] = []
        self._saved: list[Any] = []

    def __enter__(self) -> Replay:
        import torch

        for layer, gate in enumerate(self.gates):
            original = gate.forward
            norm = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral's router always renormalises

            def forward(hidden_states: Any, _orig: Any = original, _layer: int = layer, _norm: bool = norm) -> Any:
                logits, scores, idx = _orig(hidden_states)
                ids = torch.as_tensor(self.routes[:, _layer], dtype=torch.long, device=logits.device)
                probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)
                if _norm:
                    probs = probs / probs.sum(dim=-1, keepdim=True)
                self.chosen.append(ids.cpu().numpy())
                return logits, probs.to(scores.dtype), ids.to(idx.dtype)

            self._saved.append((gate, original))
            gate.forward = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        for gate, original in self._saved:
            gate.forward = original
        self._saved = []
