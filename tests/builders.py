"""Real (tiny) models for tests: a byte-level BPE tokenizer trained here and a random Llama.

Both HF and vLLM load these folders like any checkpoint; they are small enough to start fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LPP_TEST_CACHE", REPO / ".test-cache"))

CORPUS = [
    "Dave lives in Palm Coast, FL and is a lawyer.",
    "His personal interests include playing guitar, hiking, and spending time with his family.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "Numbers like 3.14159 and 2.71828 appear in mathematics, physics and engineering.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber and \u65e5\u672c\u8a9e are spelled with bytes beyond ASCII.",
] * 20


def build_tokenizer(out: Path, adds_bos: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


def build_tiny_llama(name: str = "tiny-llama-bos", adds_bos: bool = True, max_positions: int = 128) -> Path:
    """A 2-layer random Llama (head_dim 32, which vLLM's CPU attention supports)."""
    out = CACHE / name
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp, adds_bos)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=0.5,  # peaky distributions, so logprobs spread like a real model's
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out


def build_tiny_openai_gpt() -> Path:
    """An architecture HF runs but vLLM does not (OpenAI GPT-1), for the 'unsupported' message."""
    out = CACHE / "tiny-openai-gpt"
    if (out / "config.json").is_file():
        return out
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp, adds_bos=True)
    OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=1, n_head=2)).save_pretrained(tmp)
    tmp.rename(out)
    return out
