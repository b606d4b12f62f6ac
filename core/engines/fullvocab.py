"""The exact full-vocabulary KL(HF || vLLM) without moving a vocabulary through Python objects.

vLLM computes every prompt position's full float32 logprobs anyway (its prompt_logprobs path keeps
only the top k). Inside our vLLM host (its engine core runs in-process), a wrapper on the sampler's
`gather_logprobs` copies those rows, as they are, into one `.npy` file a sequence in a folder on
shared memory (/dev/shm where there is one). The HF host then memory-maps each file and computes,
block by block beside its own float32 log_softmax, KL = Σ_v p_HF(v) (log p_HF(v) − log p_vLLM(v))
in float64. No Python object per vocabulary entry exists on either side, and the folder is removed
when the comparison is done.

vLLM has two model runners, and each computes prompt logprobs in its own place:
- the v1 runner (vLLM's CPU build, and GPUs before the v2 runner became their default) calls the
  sampler's `gather_logprobs` on a request's full logprobs from `_get_prompt_logprobs_dict`; the
  wrapper finds the request and its first position in that caller's frame;
- the v2 runner (`vllm/v1/worker/gpu/`, the GPU default for dense models in vLLM 0.26, and
  `VLLM_USE_V2_MODEL_RUNNER=1` on a CPU with triton-cpu) never makes full logprobs: its `PromptLogprobsWorker`
  takes the top k from each chunk of logits. There the wrapper wraps the chunk's `logits_fn` and
  takes the float32 log_softmax of each chunk's rows, mapped to requests by the input batch.
Where a vLLM build computes prompt logprobs elsewhere, nothing is captured and the run says why.
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
RUNNER_FILE = "runner.txt"  # which vLLM model runner's path the rows came from: "v1" or "v2"
PREFIX = "lpp-fullvocab-"  # then the creating process's pid

# Per vLLM host process: where the wrapper writes while a capture is on.
_STATE: dict[str, Any] = {"dir": None, "files": {}, "error": None, "runner": None}


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
    """Wrap this worker's prompt-logprob path once (run through LLM.collective_rpc, in-process);
    returns which runner it wrapped."""
    runner = worker.model_runner
    if getattr(runner, "prompt_logprobs_worker", None) is not None:
        _STATE["runner"] = _install_v2(runner.prompt_logprobs_worker)
        return _STATE["runner"]
    _STATE["runner"] = "v1"
    sampler = runner.sampler
    if getattr(sampler, "_lpp_fullvocab", False):
        return "v1"
    original = sampler.gather_logprobs

    def gather_logprobs(logprobs: Any, num_logprobs: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE["dir"] is not None:
            _capture(sys._getframe(1).f_locals, logprobs)
        return original(logprobs, num_logprobs, token_ids, *args, **kwargs)

    sampler.gather_logprobs = gather_logprobs
    sampler._lpp_fullvocab = True
    return "v1"


def _install_v2(worker: Any) -> str:
    """The v2 runner: wrap `PromptLogprobsWorker.compute_prompt_logprobs` on this instance."""
    if getattr(worker, "_lpp_fullvocab", False):
        return "v2"
    original = worker.compute_prompt_logprobs

    def compute_prompt_logprobs(logits_fn: Any, hidden_states: Any, input_batch: Any, all_token_ids: Any,
                                num_computed_tokens: Any, prompt_lens: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE["dir"] is not None:
            try:
                logits_fn = _capturing_v2(worker, logits_fn, input_batch, all_token_ids, prompt_lens)
            except Exception as exc:  # a vLLM whose input batch has other fields: say so, score on
                _STATE["error"] = f"this vLLM build's v2 model runner could not be read ({type(exc).__name__}: {exc})"
        return original(logits_fn, hidden_states, input_batch, all_token_ids, num_computed_tokens, prompt_lens,
                        *args, **kwargs)

    worker.compute_prompt_logprobs = compute_prompt_logprobs
    worker._lpp_fullvocab = True
    return "v2"


def _capturing_v2(worker: Any, logits_fn: Any, batch: Any, all_token_ids: Any, prompt_lens: Any) -> Any:
    """A logits_fn that also writes each chunk's rows to their requests' files.

    vLLM calls logits_fn on consecutive chunks of the batch's rows, from row 0. Row r of request i
    (rows query_start[i] … query_start[i+1]) is prompt position num_computed_prefill[i] + r −
    query_start[i]. The last prompt position predicts the first generated token: vLLM returns no
    prompt logprob for it, and it is not kept here either."""
    import torch

    idx = batch.idx_mapping_np
    lens = np.asarray(prompt_lens)[idx]
    done = batch.num_computed_prefill_tokens_np
    starts = batch.query_start_loc_np
    needs = worker.uses_prompt_logprobs[idx] & (done < lens) & ~(lens < batch.prefill_len_np)
    files = _STATE["files"]
    plan = []  # (first row, end row, the first row's prompt position, the request)
    for i, req_id in enumerate(batch.req_ids):
        n_rows = min(int(starts[i + 1] - starts[i]), int(lens[i]) - 1 - int(done[i]))
        if not needs[i] or n_rows <= 0:
            continue
        if req_id not in files:
            ids = tuple(int(x) for x in all_token_ids[int(idx[i]), : int(lens[i])].tolist())
            files[req_id] = (ids, Path(_STATE["dir"]) / f"req-{len(files)}.npy", None)
        plan.append((int(starts[i]), int(starts[i]) + n_rows, int(done[i]), req_id))
    offset = [0]

    def capturing(hidden: Any) -> Any:
        logits = logits_fn(hidden)
        lo = offset[0]
        hi = offset[0] = lo + int(logits.shape[0])
        rows = None
        for a, b, pos, req_id in plan:
            x, y = max(a, lo), min(b, hi)
            if x >= y:
                continue
            if rows is None:
                rows = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            _rows_into(req_id, rows.shape[-1])[pos + x - a : pos + y - a] = rows[x - lo : y - lo]
        return logits

    return capturing


def _rows_into(req_id: str, vocab: int) -> np.ndarray:
    """The request's memory-mapped file, made on its first rows (the vocabulary width is known then)."""
    ids, path, arr = _STATE["files"][req_id]
    if arr is None:
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(len(ids) - 1, vocab))
        _STATE["files"][req_id] = (ids, path, arr)
    return arr


def _capture(caller: dict[str, Any], logprobs: Any) -> None:
    request, start, req_id = caller.get("request"), caller.get("start_idx"), caller.get("req_id")
    if request is None or start is None or req_id is None or getattr(request, "prompt_token_ids", None) is None:
        _STATE["error"] = "this vLLM build computes prompt logprobs outside the code path the capture wraps"
        return
    files = _STATE["files"]
    if req_id not in files:
        ids = tuple(int(x) for x in request.prompt_token_ids)
        files[req_id] = (ids, Path(_STATE["dir"]) / f"req-{len(files)}.npy", None)
    rows = logprobs.float().cpu().numpy()
    _rows_into(req_id, rows.shape[-1])[start : start + rows.shape[0]] = rows


def begin(folder: str) -> None:
    _STATE.update(dir=folder, files={}, error=None)


def finish(folder: str, sequences: list[list[int]]) -> None:
    """Stop capturing; name each sequence's file by its index (`path_of`), or write why not."""
    files, error = _STATE["files"], _STATE["error"]
    _STATE.update(dir=None, files={}, error=None)
    if _STATE["runner"]:
        Path(folder, RUNNER_FILE).write_text(_STATE["runner"])
    by_ids: dict[tuple[int, ...], list[Path]] = {}
    for ids, path, arr in files.values():
        if arr is None:  # a request none of whose rows came through
            continue
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


def runner(folder: str) -> str | None:
    """"v1" or "v2": the vLLM model runner whose prompt-logprob path the rows came from."""
    f = Path(folder, RUNNER_FILE)
    return f.read_text() if f.exists() else None


def kl_rows(lh: Any, ref: np.ndarray) -> Any:
    """KL(HF || vLLM) per row: lh is HF's float32 log_softmax [rows, V] (a torch tensor), ref vLLM's
    float32 logprobs of the same rows [rows, V]; summed in float64.

    Both rows are normalised again in float64 first: a float32 log_softmax sums to 1 only to about
    1e-7, and without this two near-identical distributions give a KL of -1e-7, which no KL can be."""
    import torch

    if tuple(ref.shape) != tuple(lh.shape):  # another vocabulary width: no exact KL, not a failed run
        return torch.full((lh.shape[0],), float("nan"), dtype=torch.float64, device=lh.device)
    lv = torch.from_numpy(np.ascontiguousarray(ref)).to(lh.device).double()
    lv = lv - torch.logsumexp(lv, dim=-1, keepdim=True)
    l64 = lh.double()
    l64 = l64 - torch.logsumexp(l64, dim=-1, keepdim=True)
    return (l64.exp() * (l64 - lv)).sum(dim=-1)
