"""Hugging Face transformers: one teacher-forced forward pass per sequence, log_softmax in float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from core.backends.base import Backend
from core.scores import TokenScores
from core.spec import EngineSettings


class HFBackend(Backend):
    name = "hf"

    def __init__(self, model_path: str, dtype: str, device: str, settings: EngineSettings, max_model_len: int):
        super().__init__(model_path, dtype, device, settings, max_model_len)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": settings.trust_remote_code}
        if settings.attn_implementation:
            kwargs["attn_implementation"] = settings.attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device).eval()

    @torch.inference_mode()
    def score(
        self, sequences: list[list[int]], top_k: int, gather_ids: list[np.ndarray] | None = None
    ) -> list[TokenScores]:
        # One sequence per forward pass: no padding, so no padding can change a value.
        return [
            self._score_one(ids, top_k, None if gather_ids is None else gather_ids[i])
            for i, ids in enumerate(sequences)
        ]

    def _score_one(self, ids: list[int], k: int, gather: np.ndarray | None) -> TokenScores:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x, use_cache=False).logits[0, :-1]  # row t-1 predicts token t
        lp = torch.log_softmax(logits.float(), dim=-1)
        target = x[0, 1:]
        target_lp = lp.gather(1, target[:, None])[:, 0]
        # vLLM's rule: rank = number of vocabulary entries >= the target's logprob.
        rank = (lp >= target_lp[:, None]).sum(dim=-1)
        top_lp, top_ids = lp.topk(k, dim=-1)

        out = TokenScores.empty(ids, k)
        out.logprob[1:] = target_lp.double().cpu().numpy()
        out.rank[1:] = rank.cpu().numpy()
        out.topk_ids[1:] = top_ids.cpu().numpy()
        out.topk_logprobs[1:] = top_lp.double().cpu().numpy()
        if gather is None:
            return out
        g = torch.as_tensor(np.asarray(gather)[1:], dtype=torch.long, device=self.device)
        vals = lp.gather(1, g.clamp(min=0)).double()
        vals[g < 0] = float("nan")
        full = np.full(np.asarray(gather).shape, np.nan)
        full[1:] = vals.cpu().numpy()
        return TokenScores(
            token_ids=out.token_ids,
            logprob=out.logprob,
            rank=out.rank,
            topk_ids=out.topk_ids,
            topk_logprobs=out.topk_logprobs,
            gathered_logprobs=full,
        )

    def info(self) -> dict[str, Any]:
        dev = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else "cpu"
        return {
            "backend": "hf",
            "device": dev,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
        }
