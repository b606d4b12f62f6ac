"""A finished comparison for one dtype: data first (frozen, numpy), with table and JSON views."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from core.metrics import TokenMetrics, summarize, token_metrics
from core.scores import TokenScores

SCHEMA_VERSION = 1
SIDES = ("hf", "vllm")


@dataclass(frozen=True, eq=False)
class SequenceResult:
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    pieces: tuple[str, ...]
    bos_added: bool
    hf: TokenScores
    vllm: TokenScores
    metrics: TokenMetrics
    summary: dict[str, Any]
    # Decoded text of each side's top-k ids, so views need no tokenizer: {"hf": [[str]*k]*T, ...}
    topk_text: dict[str, tuple[tuple[str, ...], ...]] | None = None

    @classmethod
    def build(
        cls, tok: Any, hf: TokenScores, vllm: TokenScores, decode: Callable[[int], str] | None = None
    ) -> "SequenceResult":
        """Compare two sides' scores of the same ids; refuses scores of different ids."""
        ids = np.asarray(tok.token_ids, dtype=np.int64)
        for side, sc in (("hf", hf), ("vllm", vllm)):
            if not np.array_equal(sc.token_ids, ids):
                raise AssertionError(f"{side} scored ids {sc.token_ids.tolist()} but the run has {ids.tolist()}")
        gathered = hf.gathered_logprobs
        if gathered is None:
            gathered = np.full(vllm.topk_logprobs.shape, np.nan)
        m = token_metrics(hf.logprob, vllm.logprob, hf.topk_ids[:, 0], vllm.topk_ids[:, 0], vllm.topk_logprobs, gathered)
        text = None
        if decode is not None:
            text = {
                side: tuple(tuple(decode(int(i)) if i >= 0 else "" for i in row) for row in sc.topk_ids)
                for side, sc in (("hf", hf), ("vllm", vllm))
            }
        return cls(
            tok.text, tuple(tok.token_ids), tuple(tok.tokens), tuple(tok.pieces), tok.bos_added, hf, vllm, m, summarize(m), text
        )

    def to_frame(self) -> pd.DataFrame:
        n = len(self.token_ids)
        m, hf, vl = self.metrics, self.hf, self.vllm
        gathered = hf.gathered_logprobs if hf.gathered_logprobs is not None else np.full(vl.topk_logprobs.shape, np.nan)
        return pd.DataFrame(
            {
                "index": np.arange(n, dtype=np.int64),
                "token_id": np.asarray(self.token_ids, dtype=np.int64),
                "token": list(self.tokens),
                "piece": list(self.pieces),
                "scored": m.scored,
                "hf_logprob": hf.logprob,
                "vllm_logprob": vl.logprob,
                "hf_rank": hf.rank,
                "vllm_rank": vl.rank,
                "hf_prob": m.hf_prob,
                "vllm_prob": m.vllm_prob,
                "delta": m.delta,
                "abs_delta": m.abs_delta,
                "prob_delta": m.prob_delta,
                "kl_topk": m.kl_topk,
                "argmax_agree": m.argmax_agree,
                "hf_topk_ids": list(hf.topk_ids),
                "hf_topk_logprobs": list(hf.topk_logprobs),
                "vllm_topk_ids": list(vl.topk_ids),
                "vllm_topk_logprobs": list(vl.topk_logprobs),
                "hf_at_vllm_topk": list(gathered),
                "hf_topk_text": [list(r) for r in self.topk_text["hf"]] if self.topk_text else [[]] * n,
                "vllm_topk_text": [list(r) for r in self.topk_text["vllm"]] if self.topk_text else [[]] * n,
            }
        )

    @classmethod
    def from_frame(cls, df: pd.DataFrame, info: dict[str, Any]) -> "SequenceResult":
        ids = df["token_id"].to_numpy(np.int64)

        def mat(col: str, dtype: Any) -> np.ndarray:
            return np.stack([np.asarray(v, dtype=dtype) for v in df[col]]) if len(df) else np.zeros((0, 0), dtype)

        def side(name: str, gathered: np.ndarray | None) -> TokenScores:
            return TokenScores(
                token_ids=ids,
                logprob=df[f"{name}_logprob"].to_numpy(np.float64),
                rank=df[f"{name}_rank"].to_numpy(np.int64),
                topk_ids=mat(f"{name}_topk_ids", np.int64),
                topk_logprobs=mat(f"{name}_topk_logprobs", np.float64),
                gathered_logprobs=gathered,
            )

        metrics = TokenMetrics(
            scored=df["scored"].to_numpy(bool),
            hf_prob=df["hf_prob"].to_numpy(np.float64),
            vllm_prob=df["vllm_prob"].to_numpy(np.float64),
            delta=df["delta"].to_numpy(np.float64),
            abs_delta=df["abs_delta"].to_numpy(np.float64),
            prob_delta=df["prob_delta"].to_numpy(np.float64),
            kl_topk=df["kl_topk"].to_numpy(np.float64),
            argmax_agree=df["argmax_agree"].to_numpy(bool),
        )
        return cls(
            text=info["text"],
            token_ids=tuple(int(i) for i in ids),
            tokens=tuple(df["token"]),
            pieces=tuple(df["piece"]),
            bos_added=bool(info["bos_added"]),
            hf=side("hf", mat("hf_at_vllm_topk", np.float64)),
            vllm=side("vllm", None),
            metrics=metrics,
            summary=info["summary"],
            topk_text={side: tuple(tuple(r) for r in df[f"{side}_topk_text"]) for side in SIDES}
            if len(df) and len(df["hf_topk_text"].iloc[-1])
            else None,
        )

    def positions_json(self) -> list[dict[str, Any]]:
        """The DESIGN.md per-position objects; unscored positions carry nulls."""
        out = []
        m = self.metrics
        for t, tid in enumerate(self.token_ids):
            ok = bool(m.scored[t])
            out.append(
                {
                    "index": t,
                    "token_id": tid,
                    "token": self.tokens[t],
                    "logprob": {s: _num(getattr(self, s).logprob[t]) if ok else None for s in SIDES},
                    "rank": {s: int(getattr(self, s).rank[t]) if ok else None for s in SIDES},
                    "top_k": {s: _topk(getattr(self, s), t) if ok else None for s in SIDES},
                    "delta": _num(m.delta[t]) if ok else None,
                    "abs_delta": _num(m.abs_delta[t]) if ok else None,
                    "prob_delta": _num(m.prob_delta[t]) if ok else None,
                    "kl_topk": _num(m.kl_topk[t]) if ok else None,
                    "argmax_agree": bool(m.argmax_agree[t]) if ok else None,
                }
            )
        return out


def _num(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _topk(sc: TokenScores, t: int) -> list[list[Any]]:
    return [[int(i), float(lp)] for i, lp in zip(sc.topk_ids[t], sc.topk_logprobs[t]) if i >= 0]


@dataclass(frozen=True, eq=False)
class Run:
    """One model × one dtype × a list of texts. `meta` holds everything but per-position data."""

    meta: dict[str, Any]
    sequences: tuple[SequenceResult, ...]
    from_store: bool = field(default=False, compare=False)

    @property
    def run_id(self) -> str:
        return self.meta["run_id"]

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta["summary"]

    def to_frame(self) -> pd.DataFrame:
        """One row per position of every sequence, with a `seq` column."""
        frames = [s.to_frame().assign(seq=i) for i, s in enumerate(self.sequences)]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return df[["seq"] + [c for c in df.columns if c != "seq"]]

    def to_json_dict(self) -> dict[str, Any]:
        m = self.meta
        return {
            "run_id": m["run_id"],
            "model": m["model"],
            "revision": m["revision"],
            "dtype": m["dtype"],
            "backends": m["backends"],
            "settings": m["settings"],
            "env": m["env"],
            "summary": m["summary"],
            "created": m.get("created"),
            "top_k": m["top_k"],
            "bos": m["bos"],
            "sequences": [
                {
                    "text": s.text,
                    "token_ids": list(s.token_ids),
                    "tokens": list(s.tokens),
                    "bos_added": s.bos_added,
                    "summary": s.summary,
                    "positions": s.positions_json(),
                }
                for s in self.sequences
            ],
        }
