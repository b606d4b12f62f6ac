"""Tiny random-weight checkpoints of the model families people train and serve, built offline.

Each uses its family's own config class and model class, and its own quirks where the family has
them (QKV bias, QK-norm, logit soft-capping, a sliding window shorter than the test text, tied
embeddings, OPT's `</s>` as BOS, a mixture of experts). Sizes keep vLLM's CPU kernels happy: head
size 32, hidden size a multiple of 32, gated activations for the experts. The tokenizer is the tests'
own byte-level BPE (builders.build_tokenizer) with the family's BOS convention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builders import CACHE, build_tokenizer, one_build_at_a_time

WINDOW = 16  # sliding window of the windowed families: the matrix's text is more than 3x longer


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: dict[str, Any]
    bos: str | None = "<s>"  # the family tokenizer's BOS token (None: it has none)
    adds_bos: bool = True  # the family's tokenizer puts it first itself
    window: int | None = None  # sliding window, when the family has one
    moe: bool = False
    quirks: tuple[str, ...] = field(default=())


_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 256,
}
_GQA = {**_BASE, "num_key_value_heads": 1, "head_dim": 32}

FAMILIES = (
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {**_GQA}, bos=None, quirks=("QKV bias", "no BOS")),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_GQA}, bos=None, quirks=("QK-norm", "no BOS")),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_GQA,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "query_pre_attn_scalar": 32,
        },
        window=WINDOW,
        quirks=("logit soft-cap", "sliding window", "tied embeddings", "BOS required"),
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_GQA, "sliding_window": WINDOW, "query_pre_attn_scalar": 32, "sliding_window_pattern": 2},
        window=WINDOW,
        quirks=("QK-norm", "sliding window on every other layer", "tied embeddings", "BOS required"),
    ),
    Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        {**_GQA, "sliding_window": WINDOW},
        window=WINDOW,
        quirks=("sliding window",),
    ),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", {**_BASE, "num_key_value_heads": 2}, quirks=("fused QKV and gate-up",)),
    Family(
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "word_embed_proj_dim": 64},
        bos="</s>",
        quirks=("learned positions", "BOS is </s>"),
    ),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "rotary_pct": 0.25},
        bos="</s>",
        adds_bos=False,
        quirks=("partial rotary", "parallel residual", "BOS = EOS, not added by its tokenizer"),
    ),
    Family(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 256},
        bos="</s>",
        adds_bos=False,
        quirks=("learned positions", "tied embeddings", "BOS = EOS, not added by its tokenizer"),
    ),
    Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_GQA, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1},
        bos=None,
        moe=True,
        quirks=("mixture of experts, 8 experts top-2", "QK-norm", "no BOS"),
    ),
    Family(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
        moe=True,
        quirks=("mixture of experts, 4 experts top-2",),
    ),
    Family(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**_BASE, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2},
        moe=True,
        quirks=("mixture of experts, 8 experts top-2", "QK-norm"),
    ),
)


# A family transformers runs and this vLLM does not (no vLLM class, and its HF code is not one vLLM's
# Transformers backend takes): the matrix's refusal case.
REFUSED = Family(
    "codegen",
    "CodeGenConfig",
    "CodeGenForCausalLM",
    {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 256, "rotary_dim": 16},
    bos="</s>",
    adds_bos=False,
    quirks=("no vLLM implementation",),
)


# Out of the matrix: vLLM's CPU MLA disagrees with itself (docs/concepts/families.md). Kept for the layer
# part, which says where its gap is born (tests/test_layers.py). MLA with a 512 latent and a 64 rope
# head: the 576-wide latent heads vLLM's CPU MLA takes; DeepSeek's own nope and v head sizes.
DEEPSEEK_V2 = Family(
    "deepseek_v2",
    "DeepseekV2Config",
    "DeepseekV2ForCausalLM",
    {
        **_BASE,
        "num_key_value_heads": 2,
        "moe_intermediate_size": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 0,
        "topk_method": "greedy",
        "n_group": 1,  # vLLM routes DeepSeek-V2 by groups: one group of all 8 experts is plain top-2
        "topk_group": 1,
    },
    moe=True,
    quirks=("multi-head latent attention", "mixture of experts, 8 experts top-2, one shared"),
)


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


@one_build_at_a_time
def build_family(f: Family) -> Path:
    """The family's tiny checkpoint (random weights, float32), built once under the tests' cache."""
    out = CACHE / f"tiny-{f.name}"
    if (out / "model.safetensors").is_file():
        return out
    import shutil

    import torch
    import transformers

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, adds_bos=f.adds_bos, bos=f.bos)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    special = {"bos_token_id": {None: None, "<s>": 0, "</s>": 1}[f.bos], "eos_token_id": 1}
    cfg = getattr(transformers, f.config)(vocab_size=vocab, initializer_range=0.5, **special, **f.kwargs)
    cfg.pad_token_id = 2  # <unk>: some configs default to an id beyond the tiny vocabulary
    torch.manual_seed(0)
    model = getattr(transformers, f.model)(cfg).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out
