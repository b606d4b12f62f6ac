"""How much memory an engine needs and how much the device has: sizes from the model's files, not guesses.

Used to size vLLM's KV cache, to decide whether engines can start side by side, to evict warm
engines before a new one would not fit, and to choose tensor parallelism. Nothing here starts CUDA:
the GPU is read through nvidia-smi, so the dashboard process never holds a CUDA context.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
GIB = 1 << 30
# CUDA context, allocator slack and kernels' workspaces, per engine process.
PROCESS_OVERHEAD = {"cpu": GIB // 2, "cuda": 2 * GIB}
# Tokens of KV cache per vLLM engine, as (sequences of max_model_len, at least this many tokens):
# on a GPU enough for a full scheduler step of long prompts, on the CPU a few sequences.
KV_TOKENS = {"cpu": (4, 4096), "cuda": (8, 32768)}


@lru_cache(maxsize=64)
def param_count(model_path: str) -> int:
    """Parameters in the folder's safetensors files, read from their headers (no weights loaded)."""
    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    if total == 0:  # .bin checkpoints: assume 2 bytes a parameter
        total = sum(f.stat().st_size for f in Path(model_path).glob("*.bin")) // 2
    return total


@lru_cache(maxsize=64)
def text_config(model_path: str, trust_remote_code: bool) -> Any:
    """The model's (text) config, parsed once per folder: every engine estimate reads it."""
    from logprob_parity.env import from_transformers

    AutoConfig = from_transformers("AutoConfig")

    cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return getattr(cfg, "text_config", None) or cfg


def kv_bytes_per_token(model_path: str, dtype: str, trust_remote_code: bool = False) -> int:
    cfg = text_config(model_path, trust_remote_code)
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * ELEM_BYTES[dtype]


def kv_cache_bytes(model_path: str, dtype: str, max_model_len: int, device: str, trust_remote_code: bool = False) -> int:
    """vLLM's KV cache, sized from the model (KV_TOKENS), between 64 MiB and 4 GiB, and never below
    one whole sequence of max_model_len (a 32k-token text of an 8B model needs 4.3 GB): a prompt that
    does not fit the cache cannot be scored at all. An explicit size also skips vLLM's guess from free
    memory, which engines starting side by side would skew."""
    seqs, least = KV_TOKENS[device]
    per_token = kv_bytes_per_token(model_path, dtype, trust_remote_code)
    want = per_token * max(seqs * max_model_len, least)
    return int(min(max(want, 64 << 20), max(4 * GIB, per_token * (max_model_len + 256))))


def weight_bytes(model_path: str, dtype: str) -> int:
    return param_count(model_path) * ELEM_BYTES[dtype]


def engine_bytes(backend: str, model_path: str, dtype: str, device: str, max_model_len: int, settings: Any) -> int:
    """Peak memory one engine host takes on its device, per GPU when the model is split."""
    split = 1
    if backend == "vllm":
        split = (settings.tensor_parallel_size or 1) * (settings.pipeline_parallel_size or 1)
    need = weight_bytes(model_path, dtype) // split + PROCESS_OVERHEAD[device]
    cfg = text_config(model_path, settings.trust_remote_code)
    vocab = getattr(cfg, "vocab_size", 50_000)
    if backend == "vllm":
        need += kv_cache_bytes(model_path, dtype, max_model_len, device, settings.trust_remote_code) // split
        # the profile run: logits of max_num_batched_tokens rows in float32
        need += (settings.max_num_batched_tokens or 8192) * vocab * 4
    else:
        # one padded batch's logits in the model dtype, plus a float32 block of rows
        need += (settings.hf_batch_size or 1) * max_model_len * vocab * (ELEM_BYTES[dtype] + 4)
    return int(need)


def engine_share(model_path: str, dtype: str, max_model_len: int, settings: Any) -> float:
    """gpu_memory_utilization for a vLLM engine whose KV cache is sized explicitly: vLLM only checks
    at start that this share of the card is free, so ask for what the engine will really take."""
    total = min(gpu_totals(), default=0)
    if not total:
        return 0.9
    need = engine_bytes("vllm", model_path, dtype, "cuda", max_model_len, settings)
    return round(min(max(need / total, 0.02), 0.9), 3)


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total: int  # bytes
    free: int  # bytes


def gpus() -> list[GPU]:
    """The NVIDIA GPUs visible here and their memory, from nvidia-smi (none without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        idx, name, total, free = (p.strip() for p in line.split(","))
        found.append(GPU(int(idx), name, int(total) << 20, int(free) << 20))
    return found


@lru_cache(maxsize=1)
def gpu_cards() -> tuple[GPU, ...]:
    """The GPUs as nvidia-smi listed them the first time this process asked (calling it takes a tenth
    of a second): for what does not change, their number, names and total memory, never free memory."""
    return tuple(gpus())


def gpu_totals() -> tuple[int, ...]:
    """Each GPU's total memory (gpu_cards)."""
    return tuple(g.total for g in gpu_cards())


def free_bytes(device: str) -> int:
    """Free memory where engines run: the least free GPU, or the RAM the kernel says is available."""
    if device == "cuda":
        return min((g.free for g in gpus()), default=0)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
