"""Sizes: as people write them (80GB, 24 GiB, 512MB: the device memory cap's reading), and runs of
consecutive sizes within a bound (packed rows, the batches of one turn)."""

from __future__ import annotations

import re

from logprob_parity.errors import UserError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(text: str) -> int:
    """Bytes from a size as people write it: 80GB, 80 GB, 79.6GiB, 512MiB (GB = 10^9 bytes, as a card's
    label counts; GiB = 2^30). A bare number is bytes. Anything else is refused in words."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"device_memory must be a size such as 80GB, 24GiB or 512MB (got {text!r})")
    got = int(float(m.group(1)) * _UNITS[unit])
    if got <= 0:
        raise UserError(f"device_memory must be more than 0 (got {text!r})")
    return got


def consecutive(sizes: list[int], bound: int) -> list[list[int]]:
    """Indices in order, in runs whose sizes add up to at most `bound`; one larger than the bound gets
    a run of its own (every run holds at least one index)."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if out and used + n <= bound:
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out
