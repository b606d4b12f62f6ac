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

from logprob_parity.inputs.sizes import parse_size

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


def cap_of(settings: Any) -> int | None:
    """The device memory cap these settings set (their device_memory), in bytes; None: no cap."""
    value = getattr(settings, "device_memory", None)
    return parse_size(value) if value else None


def sleeps_in_turn(device: str, settings: Any) -> bool:
    """Whether an engine on `device` with these settings sleeps between turns instead of stopping: on a
    GPU (CUDA or ROCm, where vLLM's sleep mode exists) under a memory cap. The one rule behind vLLM's
    `enable_sleep_mode`, its pinned host allocation (`LoadRequest.host_env`) and the pool's choice to
    put an engine to sleep for room rather than stop it (HF sleeps by its host copy)."""
    return device.startswith("cuda") and cap_of(settings) is not None


def size_words(n: float) -> str:
    """A size in GB (10^9 bytes), as the cap is written: 61 GB, 2.4 GB, 0.31 GB."""
    gb = n / 1e9
    return f"{gb:.0f} GB" if gb >= 10 else f"{gb:.2g} GB" if gb < 1 else f"{gb:.1f} GB"


@dataclass(frozen=True)
class Fit:
    """How a dtype's two engines fit on their device: side by side, or in turn (each alone while the
    other sleeps or stops), with the sizes that decided it in words. A model vLLM cannot serve alone
    never gets a Fit: `plan_fit` refuses it."""

    in_turn: bool
    words: str
    limit: int  # the bytes the engines may take: the cap, or the device's memory
    vllm_bytes: int
    hf_bytes: int


def device_limit(device: str, cap: int | None) -> tuple[int, str]:
    """(the bytes our engines may take on `device`, what that is in words): the cap when set, else a
    GPU's total memory; a CPU without a cap has no limit of ours (0)."""
    if cap:
        return cap, f"the memory cap is {size_words(cap)}"
    if device.startswith("cuda"):
        total = min(gpu_totals(), default=0)
        return total, f"this card has {size_words(total)}"
    return 0, ""


def plan_fit(model_name: str, vllm: Any, hf: Any) -> Fit:
    """Side by side or in turn, for one dtype's vLLM and HF LoadRequests, from the model's files;
    a UserError in words, before anything loads, when vLLM alone (or HF alone) cannot fit."""
    from logprob_parity.errors import UserError

    cap = cap_of(vllm.settings) or cap_of(hf.settings)
    need_v = engine_bytes(vllm.backend, vllm.model_path, vllm.dtype, vllm.device, vllm.max_model_len, vllm.settings)
    need_h = engine_bytes(hf.backend, hf.model_path, hf.dtype, hf.device, hf.max_model_len, hf.settings)
    limit, where = device_limit(vllm.device, cap)
    weights = weight_bytes(vllm.model_path, vllm.dtype)
    head = (
        f"{model_name} needs {size_words(weights)} for weights in {vllm.dtype}; {where}"
        if where
        else f"{model_name} needs {size_words(weights)} for weights in {vllm.dtype}"
    )
    if not limit or need_v + need_h <= limit:
        return Fit(
            False, f"{head}: vLLM ({size_words(need_v)}) and HF ({size_words(need_h)}) fit side by side", limit, need_v, need_h
        )
    if need_v > limit:
        raise UserError(
            f"{head}, and vLLM alone needs {size_words(need_v)} with its KV cache and working memory "
            f"({size_words(need_v - weights)} more than the weights): it cannot be served here, so it cannot be "
            "compared here. Raise the cap, pick a smaller dtype or model, or a device with more memory."
        )
    if need_h > limit:
        raise UserError(
            f"{head}, and HF alone needs {size_words(need_h)} with one batch's logits: it cannot score here. "
            "Lower HF's batch size (hf_batch_size) or the context length, or raise the cap."
        )
    return Fit(
        True,
        f"{head}, and vLLM's KV cache and working memory need {size_words(need_v - weights)} more: vLLM fits alone "
        f"({size_words(need_v)}), HF fits alone ({size_words(need_h)}), both need {size_words(need_v + need_h)}, "
        "so the engines will run in turn",
        limit,
        need_v,
        need_h,
    )
