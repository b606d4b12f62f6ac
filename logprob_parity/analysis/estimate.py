"""Defaults sized to the device, and how long a run will take here, said before it starts.

Why: on this project's 2-core CPU the Rollout page's old defaults took 3¾ minutes (most of it the
noise floors) and the Frontier's 5½, and neither said so beforehand: a live demo stalled. The forms
read their defaults from here, the benchmark `benchmarks/page_defaults.py` times exactly these, and
each form shows `*_words` under its button.

An estimate is engine starts plus work. A start is the last one measured in this process (engines
report it as they load), else the usual range for the device. Work is the rate measured by this
process's last run of the same kind, else the rate `benchmarks/page_defaults.py` measured on this
kind of machine (named in the words, so the number traces to a file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from logprob_parity.engines.host import LAST_START

# Seconds of work, engines already warm, measured by benchmarks/page_defaults.py on the 2-core CPU
# (benchmarks/results/page_defaults_cpu.md) and on the H200 for the GPU (not yet measured there: the
# CPU's figure, which overstates a GPU). Keys: (kind, device kind) -> seconds per unit of work.
MEASURED = {
    ("rollout", "cpu"): 0.0263,  # a sampled token, with its prefill and HF rescoring, per dtype
    ("rollout_floors", "cpu"): 0.1017,  # a sampled token's share of the noise floors, per dtype
    ("frontier", "cpu"): 3.42,  # a configuration's accuracy and speed, its engine warm
}
SOURCE = "benchmarks/results/page_defaults_cpu.md"
TYPICAL_START_S = {"cpu": 40.0, "cuda": 80.0}
_RATES: dict[tuple[str, str], float] = {}  # measured by this process's own runs


@dataclass(frozen=True)
class RolloutDefaults:
    prompts: str
    samples: int
    max_tokens: int
    floors: bool


@dataclass(frozen=True)
class FrontierDefaults:
    configs: tuple[str, ...]  # names from the device's grid
    speed_load: tuple[int, int] | None  # None: the frontier's own default for the device
    repeats: int


def kind_of(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def rollout_defaults(device: str) -> RolloutDefaults:
    """On a CPU a load that finishes well under a minute on warm engines, its noise floors optional."""
    if kind_of(device) == "cpu":
        return RolloutDefaults("The capital of France is\nWrite a haiku about the sea:", 1, 16, False)
    return RolloutDefaults("The capital of France is\nWrite a haiku about the sea:", 2, 24, True)


def frontier_defaults(device: str, runnable: list[str]) -> FrontierDefaults:
    """On a CPU two configurations on a small load, on a GPU the grid's first four; each timed three
    times, so its median lies inside a spread that means something (one timing once read 31x)."""
    if kind_of(device) == "cpu":
        picked = tuple(c for c in ("float32", "bfloat16") if c in runnable) or tuple(runnable[:1])
        return FrontierDefaults(picked, (2, 64), 3)
    return FrontierDefaults(tuple(runnable[:4]), None, 3)


def record(kind: str, device: str, seconds: float, units: float) -> None:
    """A finished run's own work time (engine starts excluded), for the next estimate in this process."""
    if units > 0 and seconds > 0:
        _RATES[(kind, kind_of(device))] = seconds / units


def _rate(kind: str, device: str) -> tuple[float, str]:
    key = (kind, kind_of(device))
    if key in _RATES:
        return _RATES[key], "this server's last run"
    return MEASURED.get(key, MEASURED[(kind, "cpu")]), SOURCE


def _starts(cold: int, device: str) -> tuple[float, str]:
    if cold == 0:
        return 0.0, "its engines are already running"
    last = max((v for (_, k), v in LAST_START.items() if k == kind_of(device)), default=None)
    each = last if last is not None else TYPICAL_START_S[kind_of(device)]
    how = f"the last start here took {last:.0f} s" if last is not None else "a typical start"
    return cold * each, f"{cold} engine{'s' if cold != 1 else ''} to start ({how})"


def _words(total: float, parts: list[str]) -> str:
    rough = f"{total:.0f} s" if total < 90 else f"{total / 60:.1f} minutes"
    return f"About {rough} here: " + "; ".join(parts) + "."


def rollout_words(device: str, n_prompts: int, samples: int, max_tokens: int, n_dtypes: int, floors: bool, cold: int) -> str:
    tokens = n_prompts * samples * max_tokens * max(1, n_dtypes)
    rate, src = _rate("rollout", device)
    work = tokens * rate
    parts = [f"up to {tokens:,} sampled tokens at {rate * 1000:.0f} ms each ({src})"]
    if floors:
        frate, fsrc = _rate("rollout_floors", device)
        work += tokens * frate
        parts.append(f"the noise floors, {frate * 1000:.0f} ms a token ({fsrc})")
    start, swords = _starts(cold, device)
    return _words(work + start, [*parts, swords])


def frontier_words(device: str, n_configs: int, cold: int) -> str:
    rate, src = _rate("frontier", device)
    start, swords = _starts(cold, device)
    return _words(n_configs * rate + start, [f"{n_configs} configuration(s) at {rate:.0f} s each once warm ({src})", swords])


def cold_engines(pool: Any, model_path: str | None, wanted: list[tuple[str, str]]) -> int:
    """How many of the (backend, dtype) engines a run needs are not running in the pool for this model
    (any settings or length counts as running: a close enough estimate before a run)."""
    if model_path is None:
        return len(wanted)
    running = set()
    for key in pool.engine_keys():
        try:
            k = json.loads(key)
        except ValueError:
            continue
        if k.get("model_path") == model_path:
            running.add((k.get("backend"), k.get("dtype")))
    return sum(1 for w in wanted if w not in running)
