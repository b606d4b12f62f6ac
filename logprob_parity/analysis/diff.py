"""Two stored runs of the same model and token ids, side by side: what changed, and how the gap moved.

Teams upgrading vLLM, transformers or a kernel, or trying a dtype or a setting, ask "what did this
change do to parity?". `diff_runs(a, b)` lines up both runs' per-token gaps (the same ids, so the same
positions), lists what differs between them from their stored records (dtype, library versions,
device, engine settings), and says in words how the gap moved: "vLLM 0.26.0 → 0.32.0 widened the mean
gap 3.1x; the gap grew more than 2x at 12% of tokens".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from logprob_parity.analysis.check import same_comparison
from logprob_parity.errors import UserError

FACTOR = 2.0  # a token's gap "moved" when it grew or shrank more than this many times
TINY = 1e-12  # gaps below this count as this (an exact 0 has no ratio)


@dataclass(frozen=True)
class RunDiff:
    a: str
    b: str
    dtypes: tuple[str, str]
    changes: tuple[tuple[str, Any, Any], ...]  # (what, in A, in B)
    n_tokens: int
    mean_a: float
    mean_b: float
    max_a: float
    max_b: float
    share_wider: float  # tokens whose gap grew more than FACTOR times
    share_narrower: float  # tokens whose gap shrank more than FACTOR times
    headline: str
    movers: tuple[dict[str, Any], ...]  # the tokens whose gap moved most, largest first
    # an MoE model: each run's routing keys {"routing_flip_frac": {"a", "b"}, ...}; None for a dense one
    routing: dict[str, dict[str, Any]] | None = None
    # both runs' layer parts side by side, where each run has a diagnosis with one (analysis.layers.layer_diff)
    layers: dict[str, Any] | None = None

    def to_pandas(self) -> Any:
        """The tokens whose gap moved most, one a row."""
        import pandas as pd

        return pd.DataFrame(list(self.movers))

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "dtypes": list(self.dtypes),
            "changes": [list(c) for c in self.changes],
            "n_tokens": self.n_tokens,
            "mean_abs_delta": {"a": self.mean_a, "b": self.mean_b},
            "max_abs_delta": {"a": self.max_a, "b": self.max_b},
            "share_wider": self.share_wider,
            "share_narrower": self.share_narrower,
            "factor": FACTOR,
            "headline": self.headline,
            "movers": list(self.movers),
            **({"routing": self.routing} if self.routing else {}),
            **({"layers": self.layers} if self.layers else {}),
        }


def changes_between(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """What differs between two runs' records: dtype, library versions, device and engine settings."""
    ma, mb = a.meta, b.meta
    out: list[tuple[str, Any, Any]] = []
    if ma.dtype != mb.dtype:
        out.append(("dtype", ma.dtype, mb.dtype))
    for lib in ("vllm", "transformers", "torch"):
        va, vb = getattr(ma.env, lib), getattr(mb.env, lib)
        if va != vb:
            out.append((lib if lib != "vllm" else "vLLM", va, vb))
    if ma.env.device != mb.env.device:
        out.append(("device", ma.env.device, mb.env.device))
    ea, eb = effective(ma), effective(mb)
    for k in sorted(set(ma.settings) | set(mb.settings)):
        if k != "max_model_len" and ma.settings.get(k) != mb.settings.get(k):
            if k in ea and k in eb and ea[k] == eb[k]:
                out.append((k, ma.settings.get(k), f"{mb.settings.get(k)} (no effect: {k} {ea[k]} ran in both)"))
            else:
                out.append((k, ma.settings.get(k), mb.settings.get(k)))
    for k in ("top_k", "bos"):
        if getattr(ma, k) != getattr(mb, k):
            out.append((k, getattr(ma, k), getattr(mb, k)))
    return out


def effective(meta: Any) -> dict[str, Any]:
    """The settings as they took effect, where the engines recorded them: the attention backend vLLM's
    model runner chose (engines.backends.vllm), whatever was asked for."""
    got = (getattr(meta.env, "vllm_engine", None) or {}).get("attention_backend")
    return {"attention_backend": got} if got else {}


def noise_words(a: Any, b: Any, mean_a: float, mean_b: float) -> str | None:
    """The change in the mean gap judged against both runs' own noise (HF's mean noise floor): words
    when the change is within the larger of the two, None when it is beyond or a floor is not measured."""
    fa, fb = a.summary.get("hf_noise_mean"), b.summary.get("hf_noise_mean")
    if fa is None or fb is None:
        return None
    if abs(mean_b - mean_a) <= max(fa, fb):
        return (
            f"moved the mean gap within the noise of both runs ({mean_a:.2e} → {mean_b:.2e}; HF's own mean noise "
            f"{fa:.2e} and {fb:.2e})"
        )
    return None


def _words(changes: list[tuple[str, Any, Any]]) -> str:
    if not changes:
        return "Nothing recorded differs between the runs, yet"
    first = "; ".join(f"{what} {x} → {y}" for what, x, y in changes[:3])
    return first + (f" (and {len(changes) - 3} more)" if len(changes) > 3 else "")


def diff_runs(a: Any, b: Any, top: int = 20, store: Any = None) -> RunDiff:
    """Run b against run a, token by token. Refuses runs of other models or token ids (UserError).
    store: where to look for each run's newest diagnosis; where both hold a layer part, the diff sets
    their layer profiles side by side (`layers`)."""
    why = same_comparison(a, b)
    if why:
        raise UserError(f"runs {a.run_id} and {b.run_id} cannot be set side by side: {why}")
    cols = ["index", "abs_delta", "scored", "token_id"]
    fa, fb = a.column_frame(cols), b.column_frame(cols)
    ok = fa["scored"].to_numpy() & fb["scored"].to_numpy()
    ga, gb = fa["abs_delta"].to_numpy()[ok], fb["abs_delta"].to_numpy()[ok]
    n = int(ok.sum())
    if n == 0:
        raise UserError("the two runs have no scored position in common")
    ratio = np.maximum(gb, TINY) / np.maximum(ga, TINY)
    wider, narrower = float((ratio > FACTOR).mean()), float((ratio < 1 / FACTOR).mean())
    mean_a, mean_b = float(ga.mean()), float(gb.mean())
    changes = changes_between(a, b)
    r = max(mean_b, TINY) / max(mean_a, TINY)
    within = noise_words(a, b, mean_a, mean_b)
    if within:
        moved = within
    elif mean_a == mean_b == 0:
        moved = "left the mean gap at 0: no token has a gap in either run"
    elif mean_a == 0 or mean_b == 0:  # no ratio to give: from what to what (it read "widened 1.5e+09x")
        moved = (
            f"moved the mean gap from {mean_a:.2e} to {mean_b:.2e} ({'A' if mean_a == 0 else 'B'}'s is 0: no ratio to give); "
            f"the gap grew more than {FACTOR:g}x at {wider:.0%} of tokens"
        )
    elif r >= 1.05:
        moved = f"widened the mean gap {r:,.3g}x ({mean_a:.2e} → {mean_b:.2e}); the gap grew more than {FACTOR:g}x at {wider:.0%} of tokens"
    elif r <= 1 / 1.05:
        moved = (
            f"narrowed the mean gap {1 / r:,.3g}x ({mean_a:.2e} → {mean_b:.2e}); the gap shrank more than {FACTOR:g}x at "
            f"{narrower:.0%} of tokens"
        )
    else:
        moved = f"left the mean gap about where it was ({mean_a:.2e} → {mean_b:.2e}); {wider:.0%} of tokens grew more than {FACTOR:g}x"
    headline = f"{_words(changes)} {moved}."
    seq = fa["seq"].to_numpy()[ok]
    idx = fa["index"].to_numpy()[ok]
    tid = fa["token_id"].to_numpy()[ok]
    moved_at = np.flatnonzero(ga != gb)  # a token whose gap is the same in both did not move, whatever its ratio
    order = moved_at[np.argsort(-np.abs(np.log(ratio[moved_at])), kind="stable")[:top]]
    movers = []
    for i in order:
        s, t = int(seq[i]), int(idx[i])
        movers.append(
            {
                "prompt": s + 1,  # as people number prompts, from 1
                "position": t,
                "token_id": int(tid[i]),
                "token": a.sequences[s].pieces[t],
                "gap_a": float(ga[i]),
                "gap_b": float(gb[i]),
                # None where A's gap is 0: no ratio to give (ratio_words says "A is 0")
                "ratio": float(gb[i] / ga[i]) if ga[i] > 0 else None,
            }
        )
    return RunDiff(
        a.run_id,
        b.run_id,
        (a.dtype, b.dtype),
        tuple(changes),
        n,
        mean_a,
        mean_b,
        float(ga.max()),
        float(gb.max()),
        wider,
        narrower,
        headline,
        tuple(movers),
        _routing(a, b),
        _layers(store, a, b) if store is not None else None,
    )


def layers_of(store: Any, run: Any) -> dict[str, Any] | None:
    """The layer part of the newest diagnosis built on this run, for its dtype; None where there is none."""
    diag = store.diagnostics_for_run(run.run_id)
    out = diag.dtypes.get(run.dtype) if diag is not None else None
    return out.layers if out is not None and out.layers else None


def _layers(store: Any, a: Any, b: Any) -> dict[str, Any] | None:
    from logprob_parity.analysis.layers import layer_diff

    la, lb = layers_of(store, a), layers_of(store, b)
    return layer_diff(la, lb) if la and lb else None


ROUTING_KEYS = ("routing_flip_frac", "routing_tokens_flipped", "routing_layers_flipped_mean")


def _routing(a: Any, b: Any) -> dict[str, dict[str, Any]] | None:
    """Both runs' routing keys, when either measured routing (an MoE model)."""
    if all(r.summary.get("routing_flip_frac") is None for r in (a, b)):
        return None
    return {k: {"a": a.summary.get(k), "b": b.summary.get(k)} for k in ROUTING_KEYS}


def _pct(v: Any) -> str:
    return "not measured" if v is None else f"{v:.2%}"


def diff_text(d: RunDiff) -> str:
    """The diff as the terminal shows it."""
    lines = [d.headline, "", f"A: run {d.a} ({d.dtypes[0]})   B: run {d.b} ({d.dtypes[1]})   {d.n_tokens:,} tokens"]
    if d.changes:
        lines += ["", "what differs:"] + [f"  {what}: {x} → {y}" for what, x, y in d.changes]
    lines += [
        "",
        f"mean |Δ logp|  A {d.mean_a:.3e}  B {d.mean_b:.3e}",
        f"max  |Δ logp|  A {d.max_a:.3e}  B {d.max_b:.3e}",
        f"tokens whose gap grew more than {FACTOR:g}x: {d.share_wider:.1%}; shrank more than {FACTOR:g}x: {d.share_narrower:.1%}",
        *(
            [
                "MoE routing against HF: "
                + "; ".join(
                    f"{w} A {_pct(d.routing[k]['a'])} B {_pct(d.routing[k]['b'])}"
                    for k, w in (("routing_tokens_flipped", "tokens routed differently"), ("routing_flip_frac", "routers"))
                )
            ]
            if d.routing
            else []
        ),
        *([f"where in the network: {d.layers.get('words') or d.layers.get('why')}"] if d.layers else []),
        "",
        "tokens whose gap moved most:",
    ]
    for m in d.movers[:10]:
        lines.append(
            f"  prompt {m['prompt']} position {m['position']} {m['token']!r}: {m['gap_a']:.2e} → {m['gap_b']:.2e} "
            f"({ratio_words(m)})"
        )
    if not d.movers:
        lines.append("  no token moved: every token has the same gap in both runs")
    return "\n".join(lines)


def ratio_words(m: dict[str, Any]) -> str:
    """A mover's B / A in words: '3.2x', or 'A is 0' where there is no ratio to give."""
    return "A is 0" if m.get("ratio") is None else f"{m['ratio']:.3g}x"
