"""vLLM: prompt_logprobs over the exact token ids (TokensPrompt), raw logprobs, ranks from vLLM itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from core.backends.base import Backend
from core.scores import TokenScores
from core.spec import MAX_TOP_K, EngineSettings

_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# Default share of GPU memory one vLLM engine takes on CUDA: three warm engines (one per dtype) and
# the HF models fit on one card (core.engines keeps at most LPP_MAX_GPU_ENGINES vLLM engines warm).
CUDA_MEMORY_SHARE = 0.12


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int, trust_remote_code: bool) -> int:
    """On CPU vLLM sizes its KV cache from RAM; an explicit size skips that guess and its warm-up pass.

    Enough for four sequences of max_model_len (at least 4096 tokens), between 64 MiB and 4 GiB.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * _ELEM_BYTES[dtype]
    want = per_token * max(4 * max_model_len, 4096)
    return int(min(max(want, 64 << 20), 4 << 30))


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, model_path: str, dtype: str, device: str, settings: EngineSettings, max_model_len: int):
        super().__init__(model_path, dtype, device, settings, max_model_len)
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_logprobs": MAX_TOP_K,
            "logprobs_mode": "raw_logprobs",
            "enforce_eager": settings.enforce_eager,
            "enable_prefix_caching": settings.enable_prefix_caching,
            "seed": settings.seed,
            "trust_remote_code": settings.trust_remote_code,
        }
        if settings.enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = settings.enable_chunked_prefill
        if settings.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
        if settings.max_num_seqs is not None:
            kwargs["max_num_seqs"] = settings.max_num_seqs
        if settings.attention_backend:
            kwargs["attention_backend"] = settings.attention_backend
        if device == "cpu":
            if settings.gpu_memory_utilization is not None:
                kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
            else:
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    model_path, dtype, max_model_len, settings.trust_remote_code
                )
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization or CUDA_MEMORY_SHARE
        self.engine_kwargs = kwargs
        self.llm = LLM(**kwargs)

    def score(
        self,
        sequences: list[list[int]],
        top_k: int,
        gather_ids: list[np.ndarray] | None = None,
        batch_size: int | None = None,
        padding_side: str = "right",
    ) -> list[TokenScores]:
        """Default: every sequence in one generate call (vLLM batches them); batch_size=1 scores
        each alone, which the noise-floor diagnostics compare against."""
        params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=0.0, detokenize=False)
        bs = batch_size or max(1, len(sequences))
        results: list[TokenScores] = []
        for start in range(0, len(sequences), bs):
            chunk = sequences[start : start + bs]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in chunk], params, use_tqdm=False)
            results.extend(self._parse(list(ids), out, top_k) for ids, out in zip(chunk, outputs))
        return results

    def generate(self, sequences: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    @staticmethod
    def _parse(ids: list[int], out: Any, k: int) -> TokenScores:
        if list(out.prompt_token_ids) != ids:
            raise AssertionError(f"vLLM scored other ids than it was given: {list(out.prompt_token_ids)} != {ids}")
        res = TokenScores.empty(ids, k)
        for t in range(1, len(ids)):
            entries = out.prompt_logprobs[t]
            target = entries[ids[t]]
            res.logprob[t] = target.logprob
            res.rank[t] = target.rank
            # vLLM returns the top-k plus the target; the target is the extra entry when it is not in the top-k.
            items = [(tid, lp) for tid, lp in entries.items() if len(entries) <= k or tid != ids[t]]
            items.sort(key=lambda e: (e[1].rank, -e[1].logprob))
            for j, (tid, lp) in enumerate(items[:k]):
                res.topk_ids[t, j] = tid
                res.topk_logprobs[t, j] = lp.logprob
        return res

    def info(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        device = "cpu"
        if torch.cuda.is_available() and not current_platform.is_cpu():
            device = torch.cuda.get_device_name(0)
        cfg = self.llm.llm_engine.vllm_config
        return {
            "backend": "vllm",
            "device": device,
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "platform": type(current_platform).__name__,
            "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
            "max_model_len": cfg.model_config.max_model_len,
            "enforce_eager": cfg.model_config.enforce_eager,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "engine_kwargs": {k: v for k, v in self.engine_kwargs.items() if k not in ("model", "tokenizer")},
        }

    def close(self) -> None:
        shutdown = getattr(self.llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
