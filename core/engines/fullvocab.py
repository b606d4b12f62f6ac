"""The exact full-vocabulary KL(HF || vLLM) without moving a vocabulary through Python objects.

vLLM computes every prompt position's full float32 logprobs anyway (its prompt_logprobs path keeps
only the top k). Inside our vLLM host (its engine core runs in-process), a wrapper on the sampler's
`gather_logprobs` copies those rows, as they are, into one `.npy` file a sequence in a folder on
shared memory (/dev/shm where there is one). The HF host then memory-maps each file and computes,
block by block beside its own float32 log_softmax, KL = Σ_v p_HF(v) (log p_HF(v) − log p_vLLM(v))
in float64. No Python object per vocabulary entry exists on either side, and the folder is removed
when the comparison is done.

The wrapper finds the request and its first position in the caller's frame (vLLM's
`_get_prompt_logprobs_dict`, the v1 model runner that vLLM's CPU build uses). Where a vLLM build
computes prompt logprobs elsewhere, nothing is captured and the run records why (`UNSUPPORTED`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# Above this many bytes of float32 [positions, vocab] a run skips the exact KL (it says so).
MAX_BYTES = int(os.environ.get("LPP_FULL_KL_MAX_BYTES", str(4 << 30)))
ERROR_FILE = "error.txt"
PREFIX = "lpp-fullvocab-"  # then the creating process's pid

# Per vLLM host process: where the wrapper writes while a capture is on.
_STATE: dict[str, Any] = {"dir": None, "files": {}, "error": None}


def new_folder(need_bytes: int = 0) -> str | None:
    """A private folder for the full logprobs: on /dev/shm when it has room for `need_bytes` (a
    container's /dev/shm is often 64 MiB, and a memory map past its end kills the process), else
    in the temp folder when that has room, else None."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            if not os.access(base, os.W_OK):
                continue
            _remove_orphans(base)
            if shutil.disk_usage(base).free > need_bytes + (64 << 20):
                return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
        except OSError:
            continue
    return None


def _remove_orphans(base: str) -> None:
    """Folders left by a process that was killed mid-comparison (its pid is in the name): gone."""
    for path in Path(base).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def need_bytes(n_positions: int, vocab: int | None) -> int:
    return n_positions * (vocab or 0) * 4


def fits(n_positions: int, vocab: int | None) -> str | None:
    """None when the exact KL of this many positions fits MAX_BYTES, else why not."""
    if not vocab:
        return "the model's vocabulary size is unknown"
    need = need_bytes(n_positions, vocab)
    if need > MAX_BYTES:
        return (f"{n_positions} positions x {vocab} vocabulary entries is {need / 2**30:.1f} GiB of float32, above "
                f"LPP_FULL_KL_MAX_BYTES ({MAX_BYTES / 2**30:.1f} GiB)")
    return None


def folder_for(n_positions: int, vocab: int | None) -> tuple[str | None, str | None]:
    """(a folder for this many positions' full logprobs, None) or (None, why there is none)."""
    why = fits(n_positions, vocab)
    if why:
        return None, why
    folder = new_folder(need_bytes(n_positions, vocab))
    if folder is None:
        return None, f"no room for {need_bytes(n_positions, vocab) / 2**30:.1f} GiB of float32 in /dev/shm or the temp folder"
    return folder, None


def path_of(folder: str, i: int) -> Path:
    return Path(folder) / f"{i}.npy"


def install(worker: Any) -> str:
    """Wrap this worker's sampler once (run through LLM.collective_rpc, in-process)."""
    sampler = worker.model_runner.sampler
    if getattr(sampler, "_lpp_fullvocab", False):
        return "installed"
    original = sampler.gather_logprobs

    def gather_logprobs(logprobs: Any, num_logprobs: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE["dir"] is not None:
            _capture(sys._getframe(1).f_locals, logprobs)
        return original(logprobs, num_logprobs, token_ids, *args, **kwargs)

    sampler.gather_logprobs = gather_logprobs
    sampler._lpp_fullvocab = True
    return "installed"


def _capture(caller: dict[str, Any], logprobs: Any) -> None:
    request, start, req_id = caller.get("request"), caller.get("start_idx"), caller.get("req_id")
    if request is None or start is None or req_id is None or getattr(request, "prompt_token_ids", None) is None:
        _STATE["error"] = "this vLLM build computes prompt logprobs outside the code path the capture wraps"
        return
    files = _STATE["files"]
    if req_id not in files:
        ids = tuple(int(x) for x in request.prompt_token_ids)
        path = Path(_STATE["dir"]) / f"req-{len(files)}.npy"
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(len(ids) - 1, logprobs.shape[-1]))
        files[req_id] = (ids, path, arr)
    _, _, arr = files[req_id]
    rows = logprobs.float().cpu().numpy()
    arr[start : start + rows.shape[0]] = rows


def begin(folder: str) -> None:
    _STATE.update(dir=folder, files={}, error=None)


def finish(folder: str, sequences: list[list[int]]) -> None:
    """Stop capturing; name each sequence's file by its index (`path_of`), or write why not."""
    files, error = _STATE["files"], _STATE["error"]
    _STATE.update(dir=None, files={}, error=None)
    by_ids: dict[tuple[int, ...], list[Path]] = {}
    for ids, path, arr in files.values():
        arr.flush()
        by_ids.setdefault(ids, []).append(path)
    if error is None:
        for i, seq in enumerate(sequences):
            found = by_ids.get(tuple(seq))
            if not found:
                error = f"vLLM's full logprobs of sequence {i} were not captured"
                break
            os.replace(found.pop(0), path_of(folder, i))
    if error is not None:
        Path(folder, ERROR_FILE).write_text(error)


def problem(folder: str) -> str | None:
    f = Path(folder, ERROR_FILE)
    return f.read_text() if f.exists() else None


def kl_rows(lh: Any, ref: np.ndarray) -> Any:
    """KL(HF || vLLM) per row: lh is HF's float32 log_softmax [rows, V] (a torch tensor), ref vLLM's
    float32 logprobs of the same rows [rows, V]; summed in float64."""
    import torch

    if tuple(ref.shape) != tuple(lh.shape):  # another vocabulary width: no exact KL, not a failed run
        return torch.full((lh.shape[0],), float("nan"), dtype=torch.float64, device=lh.device)
    lv = torch.from_numpy(np.ascontiguousarray(ref)).to(lh.device).double()
    l64 = lh.double()
    return (l64.exp() * (l64 - lv)).sum(dim=-1)
