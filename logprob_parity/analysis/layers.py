"""Where in the network vLLM and HF part: every decoder layer's residual stream and its attention and
MLP outputs on the same ids, each engine against HF's own noise and against HF in float64.

Why: a run says how far the engines are at each token and which setting moves the gap; the next
question an engineer asks is where it is born. They answer it today with hand-written hooks
(vllm-project/speculators#686, MaxText's layer_metrics). This part captures both engines with the
same hooks (logprob_parity.engines.layers) and judges each layer the way the rest of the tool judges
a token: against the spread of HF's own noise, not its mean.

The figures, per layer, block and token, all relative errors ‖a − b‖ / ‖b‖ of one token's vector:
- `vllm_vs_hf`: vLLM against HF (b = HF);
- `vllm_vs_ref`, `hf_vs_ref`: each engine against HF in float64 with eager attention (the model's own
  definition, every soft-cap applied, on the weights both engines load), run one layer at a time on
  HF's device (logprob_parity.engines.layers.float64_layers);
- `hf_noise`: HF against itself, the largest of three of the noise floor's variations at each token
  (the envelope): the text beside other texts, left-padded (micro-batch and padding side at once);
  the text packed after them in one row with restarting position ids (where the model's HF code reads
  them); and the text fed through HF's KV cache in chunks.

The floor of a (layer, block) is the envelope's 99.5th percentile over the text's tokens (its largest
value below 400 tokens, as for the noise tail of logprob_parity.analysis.floors), and never below the
rounding bound of the dtype, 2u / (1 − u) with u its unit roundoff: the largest relative error two
copies of one vector can have when each of its values was rounded once, to nearest, on each side. Below
it, the two engines are no more apart than rounding the same result each its own way puts them (in
bfloat16, 0.0078: a floor of u alone, 0.0039, let vLLM "part" from HF at 1.03 u, a coin flip). A token is beyond it
when vLLM against HF exceeds the floor; a (layer, block) *parts* when its median token is beyond: more
than half the tokens, where the noise puts at most 0.5%.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logprob_parity.analysis.floors import tail_value
from logprob_parity.analysis.verdict import closer_to_reference
from logprob_parity.engines import layers as lay

BLOCKS = lay.BLOCKS
BLOCK_WORDS = {"attn": "attention", "mlp": "MLP", "resid": "residual stream"}
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def rounding_bound(dtype: str) -> float:
    """2u / (1 − u): ‖a − b‖ ≤ ‖a − x‖ + ‖x − b‖ ≤ 2u‖x‖ and ‖b‖ ≥ (1 − u)‖x‖ when a and b are x with
    each value rounded to nearest (relative error at most u each)."""
    u = UNIT_ROUNDOFF.get(dtype, 0.0)
    return 2 * u / (1 - u)


HF_VARIATIONS = ("batched", "packed", "chunked")  # the one floor's variations the layer part runs (each where it can)
JUMP = 2.0  # the residual's error "jumps" at a layer when it is at least this many times the layer before's
REFERENCE_WORDS = "HF in float64 with eager attention, one layer at a time"
ERRORS = (
    "vllm_vs_hf",
    "vllm_vs_ref",
    "hf_vs_ref",
)  # the HF host's comparisons (HFBackend.layer_errors), with HF_VARIATIONS  # the HF host's comparisons (HFBackend.layer_errors)


def floor_of(noise: np.ndarray, dtype: str) -> float:
    """The (layer, block)'s floor: the envelope's noise tail (floors.tail_value: its TAIL_Q quantile, its
    largest value below TAIL_MIN_POSITIONS tokens), at least the dtype's rounding bound."""
    finite = noise[np.isfinite(noise)]
    return max(tail_value(finite) if finite.size else 0.0, rounding_bound(dtype))


STEPS = (
    "vLLM's layers, the text alone, kept on its device",
    "HF's layers (alone, beside other texts, packed after them, in chunks, and in float64 one layer at a time), "
    "each compared as it runs",
)


def profile(got: dict[str, Any], dtype: str, routing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The layer profile from the HF host's comparisons (`HFBackend.layer_errors`: "errors" holds each of
    ERRORS as [layers, blocks, tokens] relative errors; "vllm": the other engine's record)."""
    errors = {k: np.asarray(e, np.float64) for k, e in got["errors"].items()}
    variations = [v for v in HF_VARIATIONS if v in errors]
    lacking = [k for k in ERRORS if k not in errors] + ([] if variations else ["any of HF's own variations"])
    if lacking:
        raise ValueError(f"the layer part lacks {', '.join(lacking)}")
    n_layers_all = int(got["layers"])
    t = int(got["n_tokens"])
    shapes = {k: e.shape for k, e in errors.items() if e.shape != (n_layers_all, len(BLOCKS), t)}
    if shapes:
        raise ValueError(f"the engines' layers do not line up: {shapes} against {(n_layers_all, len(BLOCKS), t)}")
    per_token: dict[str, list[list[float]]] = {b: [] for b in BLOCKS}
    rows: list[dict[str, Any]] = []
    beyond_at: list[list[bool]] = []  # in (layer, block) order
    resid_err = np.zeros((n_layers_all, t))
    for layer in range(n_layers_all):
        for b, block in enumerate(BLOCKS):
            vh = errors["vllm_vs_hf"][layer, b]
            noise = np.max([errors[v][layer, b] for v in variations], axis=0)
            v_ref, h_ref = errors["vllm_vs_ref"][layer, b], errors["hf_vs_ref"][layer, b]
            floor = floor_of(noise, dtype)
            beyond = vh > floor
            if block == "resid":
                resid_err[layer] = vh
            per_token[block].append([float(v) for v in vh])
            beyond_at.append([bool(x) for x in beyond])
            rows.append(
                {
                    "layer": layer,
                    "block": block,
                    "vllm_vs_hf_median": float(np.median(vh)),
                    "vllm_vs_hf_max": float(vh.max()),
                    "vllm_vs_ref_median": float(np.median(v_ref)),
                    "hf_vs_ref_median": float(np.median(h_ref)),
                    "hf_noise_median": float(np.median(noise)),
                    "floor": floor,
                    "tokens_beyond": int(beyond.sum()),
                    "parts": bool(np.median(vh) > floor),
                }
            )
    out: dict[str, Any] = {
        "n_tokens": t,
        "layers": n_layers_all,
        "blocks": list(BLOCKS),
        "moe_layers": list(got.get("moe_layers") or []),
        "dtype": dtype,
        "unit_roundoff": UNIT_ROUNDOFF.get(dtype),
        "rounding_bound": rounding_bound(dtype),
        "variations": variations,
        "variations_skipped": dict(got.get("skipped") or {}),
        "reference": REFERENCE_WORDS,
        "vllm_record": {k: v for k, v in (got.get("vllm") or {}).items() if k not in ("pieces", "stack", "token")},
        "per_layer": rows,
        "vllm_vs_hf": per_token,
        "first_beyond": _first_beyond(beyond_at, t),
        "hf_seconds": dict(got.get("seconds") or {}),  # each of HF's captures, compared as it ran
    }
    out["parted"] = _parted(rows, beyond_at, resid_err)
    out["routing"] = _routing_grid(routing, out["moe_layers"], resid_err, rows) if routing else None
    out["words"] = layer_words(out)
    return out


def _first_beyond(beyond_at: list[list[bool]], t: int) -> list[int | None]:
    """Per token, the index into per_layer of the first (layer, block) where it is beyond the floor."""
    first: list[int | None] = [None] * t
    for k, row in enumerate(beyond_at):
        for i, b in enumerate(row):
            if b and first[i] is None:
                first[i] = k
    return first


def _parted(rows: list[dict[str, Any]], beyond_at: list[list[bool]], resid_err: np.ndarray) -> dict[str, Any] | None:
    """The first (layer, block) that parts, which tokens are beyond there, how much the residual's
    median error grows from there to the last layer, and which engine leaves float64 there."""
    k = next((i for i, r in enumerate(rows) if r["parts"]), None)
    if k is None:
        return None
    r = rows[k]
    tokens = [i for i, b in enumerate(beyond_at[k]) if b]
    last = float(np.median(resid_err[-1]))
    start = r["vllm_vs_hf_median"]
    return {
        "index": k,
        "layer": r["layer"],
        "block": r["block"],
        "tokens": tokens,
        "growth": (last / start) if start > 0 else None,
        "leaves_reference": closer_to_reference(r["vllm_vs_ref_median"], r["hf_vs_ref_median"]),
    }


def _routing_grid(
    routing: dict[str, Any], moe_layers: list[int], resid_err: np.ndarray, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The routing flips on the layer grid ([token, decoder layer] each), and how often the residual's
    error jumps (JUMP times the layer before's, or past the floor at layer 0) at a flipped (token,
    layer) against at the others: do the hidden states part *at* the flips?"""
    flips = [[int(f[0]), moe_layers[int(f[1])] if int(f[1]) < len(moe_layers) else int(f[1])] for f in routing.get("flips", [])]
    floors = {r["layer"]: r["floor"] for r in rows if r["block"] == "resid"}
    n_layers, t = resid_err.shape
    jump = np.zeros((n_layers, t), dtype=bool)
    jump[0] = resid_err[0] > floors[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        jump[1:] = (resid_err[1:] >= JUMP * resid_err[:-1]) & (
            resid_err[1:] > np.array([floors[i] for i in range(1, n_layers)])[:, None]
        )
    flipped = np.zeros_like(jump)
    for tok, layer in flips:
        if tok < t and layer < n_layers:
            flipped[layer, tok] = True
    moe = np.zeros(n_layers, dtype=bool)
    moe[[m for m in moe_layers if m < n_layers]] = True
    others = ~flipped & moe[:, None]
    return {
        "flips": flips,
        "jump_at_flips": float(jump[flipped].mean()) if flipped.any() else None,
        "jump_elsewhere": float(jump[others].mean()) if others.any() else None,
        "flipped_pairs": int(flipped.sum()),
    }


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _tokens_words(tokens: list[int], t: int) -> str:
    if len(tokens) == t:
        return "every token"
    if tokens and tokens == list(range(tokens[0], t)):
        return f"every token from the {_ordinal(tokens[0] + 1)}"
    return f"{len(tokens)} of {t} tokens"


def block_words(block: str, layer: int, moe_layers: list[int]) -> str:
    return "MoE block" if block == "mlp" and layer in moe_layers else BLOCK_WORDS[block]


def layer_words(p: dict[str, Any]) -> str:
    """The profile in one paragraph, for the verdict's audience."""
    rows, parted = p["per_layer"], p["parted"]
    if parted is None:
        worst = max(rows, key=lambda r: r["vllm_vs_hf_median"] / r["floor"] if r["floor"] > 0 else 0.0)
        return (
            f"vLLM and HF stay within HF's own noise at every layer: at each of the {p['layers']} layers and "
            f"every block, fewer than half the tokens move more than HF moves them itself (closest to parting: "
            f"layer {worst['layer']}'s {block_words(worst['block'], worst['layer'], p['moe_layers'])}, median relative "
            f"error {worst['vllm_vs_hf_median']:.2g} against HF's floor {worst['floor']:.2g})." + _routing_words(p.get("routing"))
        )
    r = rows[parted["index"]]
    where = f"layer {parted['layer']}'s {block_words(parted['block'], parted['layer'], p['moe_layers'])}"
    words = (
        f"vLLM and HF first part in {where} ({_tokens_words(parted['tokens'], p['n_tokens'])}; median relative "
        f"error {r['vllm_vs_hf_median']:.2g}, {_floor_words(r['floor'], p)})"
    )
    growth = parted["growth"]
    last = p["layers"] - 1
    if growth is not None and (parted["layer"], parted["block"]) != (last, "resid"):
        words += (
            f"; the gap grows {growth:.3g}x by the last layer's residual stream"
            if growth >= 1
            else (f"; by the last layer's residual stream it is {1 / growth:.3g}x smaller")
        )
    side = parted["leaves_reference"]
    v_ref, h_ref = r["vllm_vs_ref_median"], r["hf_vs_ref_median"]
    words += {
        "HF": f"; vLLM is the one that leaves float64 there ({v_ref:.2g} from it, HF {h_ref:.2g})",
        "vLLM": f"; HF is the one that leaves float64 there ({h_ref:.2g} from it, vLLM {v_ref:.2g})",
        "neither": (
            f"; both engines are as far from float64 there (vLLM {v_ref:.2g}, HF {h_ref:.2g}): each rounds "
            f"{p['dtype']} its own way, and neither is wrong"
        ),
    }.get(side or "", "")
    return words + "." + _routing_words(p.get("routing"))


def _floor_words(floor: float, p: dict[str, Any]) -> str:
    """What the floor a (layer, block) was judged against is: HF's own noise, or rounding alone."""
    if floor <= rounding_bound(p["dtype"]):
        return f"where rounding to {p['dtype']} alone can put them {floor:.2g} apart"
    return f"where HF moves itself by at most {floor:.2g}"


def _routing_words(rt: dict[str, Any] | None) -> str:
    """An MoE model's routing on the layer grid, in a sentence (nothing for a dense model)."""
    if rt is None:
        return ""
    if rt.get("jump_at_flips") is None:
        return " Every token was routed to the same experts on both sides."
    other = rt.get("jump_elsewhere")
    return (
        f" At {rt['jump_at_flips']:.0%} of the {rt['flipped_pairs']} (token, layer) pairs routed to other experts "
        f"the residual's error jumps at that layer"
        + (f", against {other:.0%} of the pairs routed alike." if other is not None else ".")
    )


def layer_part(
    hosts: dict[str, Any],
    ids: list[int],
    others: list[list[int]],
    dtype: str,
    routing: dict[str, Any] | None,
    say: Any = None,
) -> dict[str, Any]:
    """vLLM's capture kept on its device, HF's compared against it where HF's vectors are, then the
    profile; vLLM's stack freed after. hosts: "vllm" (or HF in its place) and "hf". A dict with "why"
    (and no profile) where vLLM's side could not be captured. say(words): each step as it starts."""

    def step(k: int) -> None:
        if say is not None:
            say(f"step {k} of {len(STEPS)}: {STEPS[k - 1]}")

    step(1)
    v = hosts["vllm"].layers(ids)
    if isinstance(v, str):
        return {"why": v}
    try:
        step(2)
        got = hosts["hf"].layer_errors(ids, v, others)
    finally:
        hosts["vllm"].release_layers(v["token"])
    return profile({**got, "vllm": v}, dtype, routing)


def layer_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two profiles of the same text side by side (e.g. before and after a kernel change): per (layer,
    block) the median relative error, vLLM against HF, in each and B / A, where each first parts, and
    the (layer, block) whose median moved most. A sentence in "why" where they cannot be set side by side."""
    if "per_layer" not in a or "per_layer" not in b:
        return {"why": "a layer part did not run in " + ("A" if "per_layer" not in a else "B")}
    if (a["layers"], a["n_tokens"], a.get("text", 0)) != (b["layers"], b["n_tokens"], b.get("text", 0)):
        return {
            "why": f"the layer parts captured other texts or models (A: {a['layers']} layers, {a['n_tokens']} tokens, "
            f"text {a.get('text', 0) + 1}; B: {b['layers']} layers, {b['n_tokens']} tokens, text {b.get('text', 0) + 1})"
        }
    rows = []
    for ra, rb in zip(a["per_layer"], b["per_layer"]):
        ma, mb = ra["vllm_vs_hf_median"], rb["vllm_vs_hf_median"]
        rows.append(
            {
                "layer": ra["layer"],
                "block": ra["block"],
                "median_a": ma,
                "median_b": mb,
                "ratio": (mb / ma) if ma > 0 else None,
                "parts_a": ra["parts"],
                "parts_b": rb["parts"],
            }
        )

    def first(p: dict[str, Any]) -> str:
        k = p.get("parted")
        return "nowhere" if k is None else f"layer {k['layer']}'s {block_words(k['block'], k['layer'], p['moe_layers'])}"

    moved = [r for r in rows if r["ratio"] is not None and r["ratio"] > 0]
    words = f"A first parts {first(a)}, B {first(b)}"
    if moved:
        top = max(moved, key=lambda r: abs(np.log(r["ratio"])))
        words += (
            f"; the median error moved most at layer {top['layer']}'s {block_words(top['block'], top['layer'], a['moe_layers'])}"
            f" ({top['median_a']:.2g} → {top['median_b']:.2g}, {top['ratio']:.3g}x)"
        )
    return {"rows": rows, "words": words + "."}
