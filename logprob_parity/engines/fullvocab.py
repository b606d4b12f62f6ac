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

Two ways for the rows to reach the HF host (`Exchange`), per batch of sequences:
- files (the CPU default): one `.npy` a sequence on /dev/shm, memory-mapped by the HF host;
- tensors (the GPU default): the rows stay on the GPU in the vLLM host, which shares them with the
  HF host through CUDA IPC (torch's tensor sharing between processes); the KL is summed on the GPU
  and only one number a position crosses to the host. No byte cap applies there: a batch holds as
  many positions as `LPP_GPU_ROWS_BYTES` allows (at least one sequence). On a CPU the same path
  shares the rows through shared-memory files (torch's file_system strategy), which is how the CPU
  tests check it against the files path (`LPP_FULL_KL_TRANSPORT=tensors`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

# Above this many bytes of float32 [positions, vocab] a batch of the files path skips the exact KL
# (it says so); comparisons plan their batches to stay below it.
MAX_BYTES = int(os.environ.get("LPP_FULL_KL_MAX_BYTES", str(4 << 30)))
ENABLED_ENV = "LPP_FULL_KL"  # 0 leaves the exact KL out of every comparison (the top-k KL stays)
ENABLED = os.environ.get(ENABLED_ENV, "1") != "0"
BACKGROUND_REMOVE_BYTES = 256 << 20  # a files batch this large is removed in the background
TRANSPORT_ENV = "LPP_FULL_KL_TRANSPORT"  # auto (tensors on a GPU, files on a CPU), files or tensors
GPU_ROWS_ENV = "LPP_GPU_ROWS_BYTES"  # rows a batch may keep on the GPU; default 15% of the card
TRANSPORT_WORDS = {
    "files": "files on shared memory, read by the HF host",
    "tensors": "tensors shared with the HF host (CUDA IPC on a GPU), summed on the device",
}
ERROR_FILE = "error.txt"
RUNNER_FILE = "runner.txt"  # which vLLM model runner's path the rows came from: "v1" or "v2"
PREFIX = "lpp-fullvocab-"  # then the creating process's pid

# Per vLLM host process: where the wrapper writes while a capture is on ("dir" for files, "token"
# for tensors), and the tensors kept for the HF host until it has read them.
_STATE: dict[str, Any] = {"dir": None, "token": None, "files": {}, "error": None, "runner": None, "sample": None}
_KEPT: dict[str, list[Any]] = {}
_KEPT_ERROR: dict[str, str] = {}


def new_folder(need_bytes: int = 0) -> str | None:
    """A private folder for the full logprobs: on /dev/shm when it has room for `need_bytes` (a
    container's /dev/shm is often 64 MiB, and a memory map past its end kills the process), else
    in the temp folder when that has room, else None."""
    for base in ("/dev/shm", tempfile.gettempdir()):  # noqa: S108 - per-process names, checked for room and removed
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
        pid = path.name[len(PREFIX) :].split("-")[0]
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
        return (
            f"{n_positions} positions x {vocab} vocabulary entries is {need / 2**30:.1f} GiB of float32, above "
            f"LPP_FULL_KL_MAX_BYTES ({MAX_BYTES / 2**30:.1f} GiB)"
        )
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
        if _capturing():
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

    def compute_prompt_logprobs(
        logits_fn: Any,
        hidden_states: Any,
        input_batch: Any,
        all_token_ids: Any,
        num_computed_tokens: Any,
        prompt_lens: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if _capturing():
            try:
                logits_fn = _capturing_v2(worker, logits_fn, input_batch, all_token_ids, prompt_lens)
            except Exception as exc:  # a vLLM whose input batch has other fields: say so, score on
                _STATE["error"] = f"this vLLM build's v2 model runner could not be read ({type(exc).__name__}: {exc})"
        return original(logits_fn, hidden_states, input_batch, all_token_ids, num_computed_tokens, prompt_lens, *args, **kwargs)

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
            files[req_id] = (ids, _new_path(len(files)), None)
        plan.append((int(starts[i]), int(starts[i]) + n_rows, int(done[i]), req_id))
    offset = [0]

    def capturing(hidden: Any) -> Any:
        logits = logits_fn(hidden)
        lo = offset[0]
        hi = offset[0] = lo + int(logits.shape[0])
        rows = None
        sampling = _STATE["token"] is None and _STATE.get("sample") is not None
        for a, b, pos, req_id in plan:
            x, y = max(a, lo), min(b, hi)
            if x >= y:
                continue
            if sampling:  # a sample: only its rows get a log_softmax (a chunk's every row is gigabytes)
                _store_rows(req_id, logits[x - lo : y - lo], pos + x - a, logits.shape[-1], logits, raw=True)
                continue
            if rows is None:
                rows = torch.log_softmax(logits.float(), dim=-1)
            _store_rows(req_id, rows[x - lo : y - lo], pos + x - a, rows.shape[-1], rows)
        return logits

    return capturing


def _capturing() -> bool:
    return _STATE["dir"] is not None or _STATE["token"] is not None


def _new_path(n: int) -> Path | None:
    return Path(_STATE["dir"]) / f"req-{n}.npy" if _STATE["dir"] is not None else None


def _store_rows(req_id: str, rows: Any, at: int, vocab: int, like: Any, raw: bool = False) -> None:
    """Rows (a tensor) into the request's array at row `at`: a tensor's view for tensors; for files
    only the sampled rows (`set_sample`), copied to the host, so rows left out cost neither the copy
    nor shared memory (the file is sparse). raw: `rows` are a sample's logits, and only the sampled
    ones get their float32 log_softmax."""
    arr = _rows_into(req_id, vocab, like)
    if arr is None:
        return
    n = rows.shape[0]
    if _STATE["token"] is not None:
        arr[at : at + n] = rows
        return
    sample = _STATE.get("sample")
    if sample is None:
        arr[at : at + n] = _host(rows)
        return
    stride, phase = sample
    first = (phase - at) % stride
    if first < n:
        picked = rows[first::stride]
        if raw:
            import torch

            picked = torch.log_softmax(picked.float(), dim=-1)
        arr[at + first : at + n : stride] = _host(picked)


def _host(rows: Any) -> np.ndarray:
    return rows.cpu().numpy() if hasattr(rows, "cpu") else np.asarray(rows)


def _rows_into(req_id: str, vocab: int, like: Any = None) -> Any:
    """The request's rows, made on its first rows (the vocabulary width is known then): a memory-
    mapped file, or a float32 tensor on the device of `like` (the logits'), a view of the batch's
    one tensor (`_arena`). A tensor that does not fit in memory marks the capture failed, with how
    much it needed, and scoring goes on."""
    ids, path, arr = _STATE["files"][req_id]
    if arr is None:
        shape = (len(ids) - 1, vocab)
        if path is not None:
            arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
        elif _STATE["error"] is not None:  # an earlier request found no room: the capture has failed
            return None
        else:
            import torch

            try:
                arr = _arena(shape, like.device)
            except torch.OutOfMemoryError:
                rows = max(shape[0], _STATE.get("rows") or 0)
                _STATE["error"] = (
                    f"no room on {like.device} for {rows} x {shape[1]} float32 rows "
                    f"({4 * rows * shape[1] / 2**30:.1f} GiB); lower {GPU_ROWS_ENV}"
                )
                return None
        _STATE["files"][req_id] = (ids, path, arr)
    return arr


def _arena(shape: tuple[int, int], device: Any) -> Any:
    """Rows for one request: the next `shape[0]` rows of one float32 tensor made for the whole batch
    (its row count came with `begin`), or a tensor of their own when they do not fit in it. One
    allocation a batch is one CUDA IPC handle for the HF host to open, not one a sequence."""
    import torch

    arena = _STATE.get("arena")
    total = _STATE.get("rows") or 0
    if arena is None and total >= shape[0]:
        arena = _STATE["arena"] = torch.empty((total, shape[1]), dtype=torch.float32, device=device)
        _STATE["cursor"] = 0
    if arena is not None and arena.shape[1] == shape[1] and arena.device == torch.device(device):
        at = _STATE["cursor"]
        if at + shape[0] <= arena.shape[0]:
            _STATE["cursor"] = at + shape[0]
            return arena[at : at + shape[0]]
    return torch.empty(shape, dtype=torch.float32, device=device)


def _capture(caller: dict[str, Any], logprobs: Any) -> None:
    request, start, req_id = caller.get("request"), caller.get("start_idx"), caller.get("req_id")
    if request is None or start is None or req_id is None or getattr(request, "prompt_token_ids", None) is None:
        _STATE["error"] = "this vLLM build computes prompt logprobs outside the code path the capture wraps"
        return
    files = _STATE["files"]
    if req_id not in files:
        ids = tuple(int(x) for x in request.prompt_token_ids)
        files[req_id] = (ids, _new_path(len(files)), None)
    rows = logprobs.float()
    _store_rows(req_id, rows, start, rows.shape[-1], rows)


def begin(target: Any) -> None:
    """Start capturing: `target` is a folder (files) or {"tensors": token} (tensors). A folder with a
    sample (`set_sample`) keeps only the sampled rows."""
    if isinstance(target, dict):
        _STATE.update(dir=None, token=target["tensors"], files={}, error=None, arena=None, rows=target.get("rows"), sample=None)
    else:
        _STATE.update(dir=target, token=None, files={}, error=None, sample=sample_in(target))


SAMPLE_FILE = "sample.txt"  # "stride phase": the files path keeps row p of each sequence iff p % stride == phase


def set_sample(folder: str, stride: int, phase: int) -> None:
    """Keep a uniform (systematic) sample of each sequence's rows in this folder: every `stride`-th
    row from row `phase`. The spool of engines in turn sets it when every row would not fit its bound."""
    Path(folder, SAMPLE_FILE).write_text(f"{int(stride)} {int(phase)}")


def sample_in(folder: Any) -> tuple[int, int] | None:
    """(stride, phase) of the folder's sample, or None: every row."""
    if not isinstance(folder, str):
        return None
    f = Path(folder, SAMPLE_FILE)
    if not f.exists():
        return None
    stride, phase = (int(x) for x in f.read_text().split())
    return (stride, phase) if stride > 1 else None


def sampled(n_rows: int, sample: tuple[int, int] | None) -> np.ndarray:
    """Which of a sequence's n_rows rows the sample keeps (all of them without a sample)."""
    if sample is None:
        return np.ones(n_rows, dtype=bool)
    stride, phase = sample
    return np.arange(n_rows) % stride == phase


def kept_of(sequences: list[list[int]], sample: tuple[int, int] | None) -> tuple[int, int, int] | None:
    """(stride, phase, rows kept) of these sequences under a sample, for `Exchange(sample=...)`; None
    without one."""
    if sample is None:
        return None
    return (*sample, sum(int(sampled(len(s) - 1, sample).sum()) for s in sequences))


def end(target: Any, sequences: list[list[int]]) -> None:
    """Stop capturing, for either kind of target (see `finish` and `keep`)."""
    if isinstance(target, dict):
        keep(target["tensors"], sequences)
    else:
        finish(target, sequences)


def keep(token: str, sequences: list[list[int]]) -> None:
    """Stop capturing into tensors; keep each sequence's rows, in order, until `release(token)`."""
    found, error = _by_ids(), _STATE["error"]
    _STATE.update(token=None, files={}, error=None, arena=None, rows=None)
    kept = []
    if error is None:
        for i, seq in enumerate(sequences):
            arrs = found.get(tuple(seq))
            if not arrs:
                error = f"vLLM's full logprobs of sequence {i} were not captured"
                break
            kept.append(arrs.pop(0))
    if error is None:
        _KEPT[token] = kept
    else:
        _KEPT_ERROR[token] = error


def share(token: str) -> dict[str, Any]:
    """{"handles": [one per sequence]} for another process to open the kept tensors (`open_rows`),
    {"error": why} when there are none, and the model runner they came from.

    A handle is plain data, so it crosses the pool's process untouched: on a GPU, torch's CUDA IPC
    handle (`reduce_tensor`: the memory stays on the card, the reader maps it); on a CPU, the name of
    the shared-memory file torch moved the rows into (a file descriptor would not cross our socket)."""
    if token not in _KEPT:
        return {"error": _KEPT_ERROR.pop(token, "vLLM left no full logprobs for this batch"), "runner": _STATE["runner"]}
    return {"handles": [handle_of(t) for t in _KEPT[token]], "runner": _STATE["runner"]}


def handle_of(t: Any) -> tuple[str, Any]:
    """Plain data for another process to open `t` by (`open_handle`), the memory not copied: torch's
    CUDA IPC handle on a GPU, the name of the shared-memory file torch moves it into on a CPU."""
    if t.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return ("cuda", reduce_tensor(t))
    manager, name, size = t.untyped_storage()._share_filename_cpu_()
    return ("cpu", (manager, name, size, t.storage_offset(), tuple(t.shape), tuple(t.stride())))


def open_handle(handle: tuple[str, Any], opened: dict[str, Any] | None = None) -> Any:
    """The tensor behind `handle_of`'s handle. opened: shared-memory files already opened, by name
    (views of one storage open it once); torch does the same for CUDA handles itself."""
    import torch

    kind, data = handle
    if kind == "cuda":
        rebuild, args = data
        return rebuild(*args)
    manager, name, size, offset, shape, stride = data
    opened = {} if opened is None else opened
    if name not in opened:
        opened[name] = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    return torch.empty(0, dtype=torch.float32).set_(opened[name], offset, shape, stride)


def release(token: str) -> None:
    """Free the kept tensors of a batch once the HF host has read them."""
    tensors = _KEPT.pop(token, None)
    _KEPT_ERROR.pop(token, None)
    if tensors and tensors[0].is_cuda:
        import torch

        del tensors
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def open_rows(source: Any) -> list[Any]:
    """Every sequence's rows from where vLLM left them (`Exchange.hf_source`), in the HF host: a
    memory map per file, or the tensors behind `share`'s handles (opened, not copied)."""
    if isinstance(source, dict):
        opened: dict[str, Any] = {}
        return [open_handle(h, opened) for h in source["handles"]]
    folder = Path(source)
    n = sum(1 for p in folder.glob("*.npy") if p.stem.isdigit())
    return [np.load(path_of(source, i), mmap_mode="r") for i in range(n)]


def _by_ids() -> dict[tuple[int, ...], list[Any]]:
    """The captured arrays of this batch, by the ids of their request (files flushed)."""
    out: dict[tuple[int, ...], list[Any]] = {}
    for ids, path, arr in _STATE["files"].values():
        if arr is None:  # a request none of whose rows came through
            continue
        if path is not None:
            arr.flush()
        out.setdefault(ids, []).append(path if path is not None else arr)
    return out


def finish(folder: str, sequences: list[list[int]]) -> None:
    """Stop capturing; name each sequence's file by its index (`path_of`), or write why not."""
    by_ids, error = _by_ids(), _STATE["error"]
    _STATE.update(dir=None, files={}, error=None, sample=None)
    if _STATE["runner"]:
        Path(folder, RUNNER_FILE).write_text(_STATE["runner"])
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
    """ "v1" or "v2": the vLLM model runner whose prompt-logprob path the rows came from."""
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
    lv = (ref if isinstance(ref, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(ref))).to(lh.device).double()
    lv = lv - torch.logsumexp(lv, dim=-1, keepdim=True)
    l64 = lh.double()
    l64 = l64 - torch.logsumexp(l64, dim=-1, keepdim=True)
    return (l64.exp() * (l64 - lv)).sum(dim=-1)


def transport(device: str) -> str:
    """ "tensors" or "files": how vLLM's rows reach the HF host on this device (TRANSPORT_ENV)."""
    how = os.environ.get(TRANSPORT_ENV, "auto")
    if how in ("files", "tensors"):
        return how
    return "tensors" if device.startswith("cuda") else "files"


def batch_bytes(device: str) -> int:
    """The most bytes of float32 rows one batch keeps for the exact KL on this device."""
    if transport(device) == "files":
        return MAX_BYTES
    if os.environ.get(GPU_ROWS_ENV):
        return int(os.environ[GPU_ROWS_ENV])
    if device.startswith("cuda"):
        from logprob_parity.engines.memory import gpu_totals

        totals = gpu_totals()
        if totals:
            return int(0.15 * min(totals))
    return MAX_BYTES


class Exchange:
    """vLLM's full rows of one batch of sequences on their way to the HF host, by the transport of
    this device. `vllm_target` goes to the vLLM host's score; `after_vllm` asks it for what the HF
    host needs (`hf_source`, or `why` there is none); `close` removes or frees the rows."""

    def __init__(
        self,
        n_positions: int,
        vocab: int | None,
        device: str,
        kind: str | None = None,
        bound: int | None = None,
        sample: tuple[int, int, int] | None = None,
    ) -> None:
        """kind: the transport, else this device's (`transport`); engines in turn pass "files", whose
        rows outlive the vLLM host's turn. bound: the most bytes these rows may take (a spool's).
        sample: (stride, phase, kept) for files: only the rows of `set_sample`'s sample are written,
        `kept` of them, so the room asked for and the limits count those rows alone (the file is sparse)."""
        self.kind = kind or transport(device)
        self.n_positions = n_positions
        self.folder: str | None = None
        self.token: str | None = None
        self.handles: list[Any] | None = None
        self.runner: str | None = None
        kept = n_positions if sample is None else sample[2]
        self.need = need_bytes(kept, vocab)
        self.why: str | None = None if vocab else "the model's vocabulary size is unknown"
        if not ENABLED:
            self.why = f"switched off ({ENABLED_ENV}=0)"
        if not self.why and bound is not None and self.need > bound:
            self.why = (
                f"this batch's rows ({self.need / 1e9:.2f} GB of float32) are more than the spool may hold "
                f"({bound / 1e9:.2f} GB, LPP_SPOOL_BYTES)"
            )
        if self.why:
            return
        if self.kind == "files":
            self.folder, self.why = folder_for(kept, vocab)
            if self.folder and sample is not None:
                set_sample(self.folder, sample[0], sample[1])
        else:
            self.token = f"{os.getpid()}-{next(_TOKENS)}"

    @property
    def vllm_target(self) -> Any:
        if self.why:
            return None
        return self.folder if self.kind == "files" else {"tensors": self.token, "rows": self.n_positions}

    def after_vllm(self, vllm_host: Any) -> None:
        if self.why:
            return
        if self.kind == "files":
            self.why, self.runner = problem(self.folder), runner(self.folder)  # type: ignore[arg-type]
            return
        got = vllm_host.share_rows(self.token)
        self.runner = got.get("runner")
        self.handles = got.get("handles")
        self.why = got.get("error")

    @property
    def hf_source(self) -> Any:
        if self.why:
            return None
        return self.folder if self.kind == "files" else {"handles": self.handles}

    def close(self, vllm_host: Any = None) -> None:
        """Remove the files or free the tensors; a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.folder and self.need >= BACKGROUND_REMOVE_BYTES:  # freeing gigabytes of shared memory takes a while
            threading.Thread(target=remove, args=(self.folder,), name="lpp-fullvocab-remove", daemon=True).start()
        elif self.folder:
            remove(self.folder)
        if self.token and vllm_host is not None:
            with contextlib.suppress(Exception):
                vllm_host.release_rows(self.token)


_TOKENS = itertools.count()
