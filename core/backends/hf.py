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
    ROW_CHUNK = 256  # positions per float32 log_softmax block

    def __init__(self, model_path: str, dtype: str, device: str, settings: EngineSettings, max_model_len: int):
        super().__init__(model_path, dtype, device, settings, max_model_len)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": settings.trust_remote_code}
        if settings.attn_implementation:
            kwargs["attn_implementation"] = settings.attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device).eval()

    @torch.inference_mode()
    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[np.ndarray] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
    ) -> list[TokenScores]:
        """Default: one sequence per forward pass, so no padding can change a value. A batch_size > 1
        pads (on `padding_side`) with correct position ids: the noise-floor diagnostics use it."""
        bs = batch_size or 1
        out: list[TokenScores] = []
        for start in range(0, len(sequences), bs):
            chunk = sequences[start : start + bs]
            for j, logits in enumerate(self._forward(chunk, padding_side)):
                i = start + j
                out.append(self._from_logits(sequences[i], logits, top_k, None if gather_ids is None else gather_ids[i]))
        return out

    def _forward(self, chunk: list[list[int]], padding_side: str) -> list[torch.Tensor]:
        """Each sequence's logits rows (row t-1 predicts token t)."""
        if len(chunk) == 1:
            x = torch.tensor(chunk, dtype=torch.long, device=self.device)
            return [self.model(input_ids=x, use_cache=False).logits[0, :-1]]
        width = max(map(len, chunk))
        x = torch.zeros((len(chunk), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(x)
        for b, ids in enumerate(chunk):
            sl = slice(0, len(ids)) if padding_side == "right" else slice(width - len(ids), width)
            x[b, sl] = torch.tensor(ids, device=self.device)
            mask[b, sl] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits
        rows = []
        for b, ids in enumerate(chunk):
            lo = 0 if padding_side == "right" else width - len(ids)
            rows.append(logits[b, lo : lo + len(ids) - 1])
        return rows

    @torch.inference_mode()
    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each sequence, one at a time (no padding)."""
        out = []
        for ids in sequences:
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                    do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0)
            out.append(y[0, len(ids) :].tolist())
        return out

    def _from_logits(self, ids: list[int], logits: torch.Tensor, k: int, gather: np.ndarray | None) -> TokenScores:
        """Row chunks of ROW_CHUNK positions: the float32 [rows, vocab] log_softmax of a long sequence
        is never held whole. log_softmax is row-wise, so chunking changes no value."""
        out = TokenScores.empty(ids, k)
        full = None if gather is None else np.full(np.asarray(gather).shape, np.nan)
        target = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
        g_all = None if gather is None else torch.as_tensor(np.asarray(gather)[1:], dtype=torch.long, device=logits.device)
        for lo in range(0, logits.shape[0], self.ROW_CHUNK):
            hi = min(lo + self.ROW_CHUNK, logits.shape[0])
            rows = logits[lo:hi]
            # float32 log_softmax, as vLLM does; a float64 reference model keeps float64
            lp = torch.log_softmax(rows if rows.dtype == torch.float64 else rows.float(), dim=-1)
            target_lp = lp.gather(1, target[lo:hi, None])[:, 0]
            # vLLM's rule: rank = number of vocabulary entries >= the target's logprob.
            rank = (lp >= target_lp[:, None]).sum(dim=-1)
            top_lp, top_ids = lp.topk(k, dim=-1)
            out.logprob[1 + lo : 1 + hi] = target_lp.double().cpu().numpy()
            out.rank[1 + lo : 1 + hi] = rank.cpu().numpy()
            out.topk_ids[1 + lo : 1 + hi] = top_ids.cpu().numpy()
            out.topk_logprobs[1 + lo : 1 + hi] = top_lp.double().cpu().numpy()
            if full is not None:
                g = g_all[lo:hi]
                vals = lp.gather(1, g.clamp(min=0)).double()
                vals[g < 0] = float("nan")
                full[1 + lo : 1 + hi] = vals.cpu().numpy()
        if full is None:
            return out
        return TokenScores(out.token_ids, out.logprob, out.rank, out.topk_ids, out.topk_logprobs, gathered_logprobs=full)

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
