"""An HF model's weights in host memory while its engine sleeps (engines in turn, on a GPU).

Why not `model.to("cpu")`: that copies every tensor through pageable memory, one at a time, on every
sleep, and again on every wake; on an H100 that was about 9 s for the 16 GB of an 8B model each way.
Here the weights go once into one page-locked (pinned) host buffer, copied asynchronously, and the
copy is kept after the wake when host memory has room for it: the weights of a model we only score
never change, so every later sleep copies nothing, and a wake is one fast host-to-device copy per tensor.

The buffer is one allocation pinned with cudaHostRegister rather than a pinned tensor per weight:
torch's pinned-memory allocator rounds each block up to a power of two, which for tens of gigabytes
of weights would waste up to half of that again.

`prepare` also copies the weights into the buffer in the background, on a CUDA stream of its own,
while the engine scores: the copy engine moves them while the compute units work, so the first sleep
copies only the few buffers a forward may rewrite (on an H100, making, pinning and filling the buffer
for the 46 GB of a 30B-A3B shape in the sleep itself took 5.4 to 6.2 s). The buffer is made only where
host memory holds it beside vLLM's sleeping weights (`fits`); else the first sleep makes it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

ALIGN = 512  # bytes: every weight's view starts on this boundary


def _slots(model: Any) -> Iterator[tuple[Any, str, str, Any]]:
    """(module, "_parameters" or "_buffers", name, tensor) of every weight and buffer of the model;
    a tied weight (one Parameter in two modules) comes once for each module."""
    for mod in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in list(getattr(mod, kind).items()):
                if t is not None:
                    yield mod, kind, name, t


class HostCopy:
    """The model's tensors in one pinned host buffer; `sleep` puts the model there, `wake` back."""

    def __init__(self) -> None:
        self.buffer: Any = None
        self.pinned = False
        self.views: dict[tuple[Any, ...], Any] = {}  # a Parameter or buffer slot -> its view in the buffer
        self._ready: threading.Thread | None = None
        self._copied = False  # the weights are in the buffer (a prepared one once its background copy is done)

    def prepare(self, model: Any) -> None:
        """Make and pin the buffer now and copy the weights into it, in the background, so the first
        sleep has almost nothing left to do. Pinning tens of gigabytes was the slow part of a first
        sleep (about 25 s for 46 GB on an H100, most of it the kernel faulting pages in one thread);
        here the pages are touched by every core first, while the engine scores."""
        if self.buffer is None and self._ready is None:
            self._ready = threading.Thread(target=self._make_and_copy, args=(model,), name="lpp-host-copy", daemon=True)
            self._ready.start()

    def _make_and_copy(self, model: Any) -> None:
        self._make(model)
        self._copy_weights(model)

    @torch.no_grad()  # copies of weights, never part of a graph
    def _copy_weights(self, model: Any) -> None:
        """Every parameter into its view, on a side stream (the scoring's kernels go on while the copy
        engine works). Parameters only: a model that is only scored never changes them, while a buffer
        may be rewritten by a forward, so `sleep` copies the buffers itself."""
        if not self.pinned:  # a pageable copy would hold the thread and the engine's host in step
            return
        side = None
        for mod, kind, name, t in _slots(model):
            if kind != "_parameters" or t.device.type != "cuda":
                continue
            view = self.views.get(self._key(mod, kind, name, t))
            if view is None or view.shape != t.shape or view.dtype != t.dtype:
                continue
            if side is None:
                torch.cuda.set_device(t.device)
                side = torch.cuda.Stream(device=t.device)
                side.wait_stream(torch.cuda.default_stream(t.device))  # the weights as loaded
            with torch.cuda.stream(side):
                view.copy_(t, non_blocking=True)
        if side is not None:
            side.synchronize()
        self._copied = True

    def _wait(self) -> None:
        if self._ready is not None:
            self._ready.join()
            self._ready = None

    @staticmethod
    def _key(mod: Any, kind: str, name: str, t: Any) -> tuple[Any, ...]:
        # a Parameter object stays the same across sleeps (its .data changes), so tied weights share
        # one copy; a buffer slot is keyed by its module and name
        return ("p", id(t)) if kind == "_parameters" else ("b", id(mod), name)

    def _make(self, model: Any) -> None:
        seen: dict[tuple[Any, ...], tuple[int, Any]] = {}
        total = 0
        for mod, kind, name, t in _slots(model):
            key = self._key(mod, kind, name, t)
            if key in seen:
                continue
            seen[key] = (total, t)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        buffer.zero_()  # every page faulted in by torch's threads, not by cudaHostRegister's one
        self.pinned = _register(buffer)
        if self.pinned:  # unpinned when the buffer goes, however it goes: a later buffer at the same
            # addresses could not be pinned while these pages still are ("resource already mapped")
            weakref.finalize(buffer, _unregister, buffer.data_ptr())
        self.buffer = buffer
        for key, (at, t) in seen.items():
            n = t.numel() * t.element_size()
            self.views[key] = self.buffer[at : at + n].view(t.dtype).view(t.shape)

    @torch.no_grad()  # copies of weights, never part of a graph
    def sleep(self, model: Any) -> None:
        """The model's tensors to host memory; the device's copies are freed once the copy is done.
        With a copy kept from an earlier sleep, only buffers (which a forward may rewrite) are copied."""
        self._wait()
        fresh = not self._copied
        if self.buffer is None:
            self._make(model)
        self._copied = True
        moves = []
        for mod, kind, name, t in _slots(model):
            if t.device.type == "cpu":
                continue
            view = self.views.get(self._key(mod, kind, name, t))
            if view is None or view.shape != t.shape or view.dtype != t.dtype:  # a buffer a forward remade
                view = t.to("cpu")
            elif fresh or kind == "_buffers":
                view.copy_(t, non_blocking=self.pinned)
            moves.append((mod, kind, name, t, view))
        torch.cuda.synchronize()
        for mod, kind, name, t, view in moves:
            if kind == "_parameters":
                t.data = view
            else:
                mod._buffers[name] = view

    @torch.no_grad()  # copies of weights, never part of a graph
    def wake(self, model: Any, device: str, keep: bool) -> None:
        """The model's tensors back on `device`; keep: the host copy stays for the next sleep (else it
        is freed, when host memory is short)."""
        for mod, kind, name, t in _slots(model):
            if t.device.type != "cpu":
                continue
            moved = t.to(device, non_blocking=self.pinned)
            if kind == "_parameters":
                t.data = moved
            else:
                mod._buffers[name] = moved
        torch.cuda.synchronize()
        if not keep:
            self.free()

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def free(self) -> None:
        """The buffer goes (its pages are unpinned as it goes, `_make`)."""
        self._wait()
        self.buffer, self.pinned, self.views, self._copied = None, False, {}, False


def fits(weights: int, free_host: int, others_on_card: int) -> bool:
    """Whether host memory holds a pinned copy of `weights` bytes beside what vLLM's sleep puts there.
    vLLM's sleeping weights are about as large as HF's. When no other process holds much of the card
    (vLLM already asleep, as when HF loads in a comparison in turn, or absent), they are out of the free
    bytes already and the copy needs its own size with a margin (1.1x); while another process holds the
    card, it will need room to sleep too (2.2x)."""
    return free_host > (1.1 if others_on_card < weights / 2 else 2.2) * weights


def host_copy_room(model: Any, device: str) -> bool:
    """Whether host memory holds HF's pinned copy beside vLLM's sleeping weights (`fits`), from
    the model's weights, host memory's free bytes and what other processes hold on the card."""
    from logprob_parity.engines.memory import free_bytes

    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    free_dev, total_dev = torch.cuda.mem_get_info(torch.device(device))
    others = total_dev - free_dev - torch.cuda.memory_reserved(torch.device(device))
    return fits(weights, free_bytes("cpu"), others)


def _register(buffer: Any) -> bool:
    """Page-lock an existing host buffer (fast asynchronous copies); False: it stays pageable."""
    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except Exception:
        return False
    if int(getattr(err, "value", err)) != 0:
        # the failure stays CUDA's last error, which the next kernel launch would raise as its own:
        # one launch here takes it (torch's launch check reads and clears it)
        with contextlib.suppress(Exception):
            torch.zeros(1, device="cuda")
        return False
    return True


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # the process is ending, or CUDA is already gone
        torch.cuda.cudart().cudaHostUnregister(ptr)
