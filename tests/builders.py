"""Real (tiny) models for tests: a byte-level BPE tokenizer trained here and a random Llama.

Both HF and vLLM load these folders like any checkpoint; they are small enough to start fast.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LPP_TEST_CACHE", REPO / ".test-cache"))

_HELD = threading.local()


def one_build_at_a_time(build):
    """Builders write under the shared cache: one at a time across the session's processes (pytest-xdist
    workers, CLIs), so a worker finds the model another built instead of writing over it. Nested
    builders (the GPTQ checkpoint builds the Llama first) take the lock once."""

    @functools.wraps(build)
    def locked(*args, **kwargs):
        if getattr(_HELD, "depth", 0):
            return build(*args, **kwargs)
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _HELD.depth = 1
            try:
                return build(*args, **kwargs)
            finally:
                _HELD.depth = 0

    return locked


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


def build_tokenizer(out: Path, adds_bos: bool, bos: str | None = "<s>") -> None:
    """A 512-entry byte-level BPE over CORPUS. `bos`: the tokenizer's BOS token (None: it has none);
    `adds_bos`: its own call puts it first, as the family's tokenizer does."""
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
    if adds_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


@one_build_at_a_time
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


@one_build_at_a_time
def build_tiny_gptq(group: int = 32) -> tuple[Path, Path]:
    """The tiny Llama's projections quantized to 4 bits by hand in GPTQ's format (symmetric,
    `group` inputs a scale, no act-order), which vLLM loads as a pre-quantized checkpoint; and a
    plain HF folder with those 4-bit weights dequantized (what the checkpoint computes, exactly).

    GPTQ's layout: qweight int32 [in/8, out], eight 4-bit values a word along the input, lowest
    bits first, each value q = round(w / scale) + 8; scales [in/group, out]; qzeros hold 8 − 1 = 7
    in every nibble (GPTQ's v1 format stores zero − 1); g_idx the group of each input."""
    base = build_tiny_llama()
    out, deq = CACHE / "tiny-llama-gptq", CACHE / "tiny-llama-gptq-dequantized"
    if (out / "model.safetensors").is_file() and (deq / "model.safetensors").is_file():
        return out, deq
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(base / "model.safetensors")
    packed, plain = {}, {}
    for k, w in sd.items():
        if not k.endswith("proj.weight"):
            packed[k] = plain[k] = w
            continue
        o, i = w.shape
        wg = w.float().reshape(o, i // group, group)
        scale = (wg.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.float16).float()  # [out, groups], as stored
        q = (torch.round(wg / scale[..., None]) + 8).clamp(0, 15).to(torch.int32)
        plain[k] = ((q - 8) * scale[..., None]).reshape(o, i).to(w.dtype)
        qt = q.reshape(o, i).t().contiguous()  # [in, out]
        qweight = torch.zeros(i // 8, o, dtype=torch.int32)
        for j in range(8):
            qweight |= (qt[j::8] & 0xF) << (4 * j)
        name = k[: -len(".weight")]
        packed[f"{name}.qweight"] = qweight
        packed[f"{name}.qzeros"] = torch.full((i // group, o // 8), 0x77777777, dtype=torch.int32)
        packed[f"{name}.scales"] = scale.t().contiguous().to(torch.float16)
        packed[f"{name}.g_idx"] = torch.arange(i, dtype=torch.int32) // group
    for folder, tensors, quant in ((out, packed, True), (deq, plain, False)):
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        save_file(tensors, tmp / "model.safetensors")
        if quant:
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True}
            (tmp / "config.json").write_text(json.dumps(cfg))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return out, deq


@one_build_at_a_time
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
