"""A fake backend for fast tests of the plumbing around engines (pool, leases, queueing, pages).

It loads no model: its "model" is a seeded random table, so its numbers mean nothing, and the real
HF and vLLM backends are what every numeric test uses. It is registered like them
(BACKEND_REGISTRY["fake"]) and stands in for both when LPP_FAKE_ENGINES=1 is set in the engine
host's environment. LPP_FAKE_LOAD_S and LPP_FAKE_SCORE_S make loading and scoring take that long,
so a test can hold an engine busy. The "vllm" role adds dtype-sized noise to the "hf" role's values,
so a comparison shows a small non-zero gap, as real engines do.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from logprob_parity.engines.backends.base import Backend
from logprob_parity.engines.scores import TokenScores

NOISE = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 3e-3, "float64": 0.0}
TABLE_BYTES = 64 << 20  # the kept log_softmax rows of one fake engine, at most


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, model_path: str, dtype: str, device: str, settings: Any, max_model_len: int, role: str = "hf") -> None:
        super().__init__(model_path, dtype, device, settings, max_model_len)
        self.role = role
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
        self._table: dict[int, np.ndarray] = {}  # seed -> its log_softmax (_logprobs)
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(row) -> (row, its argsort) (_order)
        time.sleep(float(os.environ.get("LPP_FAKE_LOAD_S", "0")))

    def _logprobs(self, context: list[int]) -> np.ndarray:
        """log_softmax of logits seeded by the last two context ids: a fixed, reproducible 'model'.
        Kept per seed (TABLE_BYTES in all): a prompt set repeats its contexts, and drawing and
        normalising a vocabulary's logits again for each was most of the plumbing tests' time."""
        seed = (context[-1] * 1_000_003 + (context[-2] if len(context) > 1 else 7)) % (2**32)
        got = self._table.get(seed)
        if got is not None:
            return got
        logits = np.random.default_rng(seed).normal(0.0, 2.0, self.vocab)
        if self.role == "vllm" and NOISE.get(self.dtype, 0.0):
            logits = logits + np.random.default_rng(seed + 1).normal(0.0, NOISE[self.dtype], self.vocab)
        z = logits - logits.max()
        lp = z - np.log(np.exp(z).sum())
        lp.flags.writeable = False  # shared by every position with this seed
        if len(self._table) >= max(1, TABLE_BYTES // lp.nbytes):
            self._table.pop(next(iter(self._table)))
        self._table[seed] = lp
        return lp

    def _order(self, lp: np.ndarray) -> np.ndarray:
        """The ids from most to least likely (a stable sort), kept beside the row it sorts."""
        got = self._orders.get(id(lp))
        if got is None or got[0] is not lp:
            got = (lp, np.argsort(-lp, kind="stable"))
            if len(self._orders) >= len(self._table) + 1:
                self._orders.pop(next(iter(self._orders)))
            self._orders[id(lp)] = got
        return got[1]

    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[Any] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
        full: Any = None,
    ) -> list[TokenScores]:
        if getattr(self, "asleep", False):
            raise RuntimeError("the fake engine was asked to score while asleep")
        time.sleep(float(os.environ.get("LPP_FAKE_SCORE_S", "0")))
        out = []
        for i, ids in enumerate(sequences):
            sc = TokenScores.empty(ids, top_k)
            gathered = np.full((len(ids), top_k), np.nan) if gather_ids is not None else None
            for t in range(1, len(ids)):
                lp = self._logprobs(ids[max(0, t - 2) : t])
                top = self._order(lp)[:top_k]
                sc.logprob[t] = lp[ids[t]]
                sc.rank[t] = int((lp >= lp[ids[t]]).sum())
                sc.topk_ids[t] = top
                sc.topk_logprobs[t] = lp[top]
                if gathered is not None:
                    g = np.asarray(gather_ids[i][t])
                    gathered[t] = np.where(g >= 0, lp[np.clip(g, 0, None)], np.nan)
            if gathered is not None:
                sc = TokenScores(sc.token_ids, sc.logprob, sc.rank, sc.topk_ids, sc.topk_logprobs, gathered)
            out.append(sc)
        return out

    def sleep(self) -> bool:
        """As the real engines on a GPU: it leaves the "device" (and refuses to score until `wake`)."""
        if not self.device.startswith("cuda"):
            return False
        self.asleep = True
        return True

    def wake(self) -> None:
        self.asleep = False

    def score_packed(self, sequences: list[list[int]], row_positions: int) -> list[TokenScores]:
        """Packing changes nothing in the fake's table (it has no kernels)."""
        return self.score(sequences, 1)

    def rollout_score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        chunk: int | None = None,
        full: Any = None,
        tail: int | None = None,
    ) -> list[dict[str, Any]]:
        """The trainer's side of a rollout, as HF's backend returns it (logprob, tempered, log_kept_mass,
        top_id), from the seeded table; top-p is not modelled (the values mean nothing, the shapes are
        right). Chunked (the noise floor): the same values as one pass (no KV cache here)."""
        if chunk is not None:
            return [{"logprob": s.logprob[st:], "first": np.asarray(st)} for s, st in zip(self.score(sequences, 1), starts)]
        if getattr(self, "asleep", False):
            raise RuntimeError("the fake engine was asked to score while asleep")
        time.sleep(float(os.environ.get("LPP_FAKE_SCORE_S", "0")))
        out = []
        for ids, st in zip(sequences, starts):
            rows = {"logprob": [], "tempered": [], "log_kept_mass": [], "top_id": []}
            for t in range(st, len(ids)):
                lp = self._logprobs(ids[max(0, t - 2) : t])
                z = lp / max(temperature, 1e-6)
                if top_k > 0:
                    z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
                z = z - z.max()
                tempered = z - np.log(np.exp(z).sum())
                rows["logprob"].append(lp[ids[t]])
                rows["tempered"].append(tempered[ids[t]])
                rows["log_kept_mass"].append(np.log(np.exp(lp[np.isfinite(z)]).sum()))
                rows["top_id"].append(int(np.argmax(lp)))
            out.append({k: np.asarray(v, dtype=np.int64 if k == "top_id" else np.float64) for k, v in rows.items()})
        return out

    def routes(self, sequences: list[list[int]]) -> str:
        return "not an MoE model"

    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out = []
        for ids in sequences:
            ctx, new = list(ids), []
            for _ in range(max_new_tokens):
                nxt = int(np.argmax(self._logprobs(ctx)))
                ctx.append(nxt)
                new.append(nxt)
            out.append(new)
        return out

    def info(self) -> dict[str, Any]:
        return {"backend": "fake", "role": self.role, "device": self.device, "dtype": self.dtype}
