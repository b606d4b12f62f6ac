"""Random-weight checkpoints with the shapes of real models of other families (issue 30's H200 part).

Each is built with its family's own config and model classes from the published config.json's
sizes, the demo model's tokenizer (its ids are a subset of every vocabulary here), random weights
(std 0.02) in bfloat16, saved as a plain HF folder. `layers` cuts the depth (the MoE shape: its 48
layers are 61 GB a copy, and both engines hold one on the card beside the KV cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# name: (config class, model class, sizes from the model's config.json)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3_8b": (  # config.json of meta-llama/Llama-3.1-8B (the 128,256-entry vocabulary)
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "qwen3_8b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
    "gemma2_9b": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 256,
            "vocab_size": 256000,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_32b": (  # the dense 30B class: Qwen3-32B's width (cut its 64 layers with --layers to fit a disk)
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "hidden_size": 5120,
            "intermediate_size": 25600,
            "num_hidden_layers": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_30b_a3b": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
}


def build_shape(name: str, out: Path, tokenizer_path: str, device: str, layers: int | None = None, **overrides: Any) -> str:
    """The shape `name` (SHAPES) with random weights, saved to `out` (kept if already there)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    if (out / "config.json").is_file():
        return str(out)
    config_cls, model_cls, sizes = SHAPES[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    kw = {**sizes, **({"num_hidden_layers": layers} if layers else {}), **overrides}
    cfg = getattr(transformers, config_cls)(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **kw)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, max_shard_size="5GB")
    tok.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(out)
