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


# engines that start together load side by side (the pool starts every engine a run needs at once
# when they fit): on the 2-core CPU the Rollout page's four engines of the demo model started and ran
# its default in 36.7 s, not 4 x 40 s (tests/test_dashboard.py, the rollout estimate's test). A GPU's
# side by side starts are not measured: counted one after another.
SIDE_BY_SIDE = {"cpu": 4, "cuda": 1}


def _starts(cold: int, device: str) -> tuple[float, str]:
    if cold == 0:
        return 0.0, "its engines are already running"
    last = max((v for (_, k), v in LAST_START.items() if k == kind_of(device)), default=None)
    each = last if last is not None else TYPICAL_START_S[kind_of(device)]
    how = f"the last start here took {last:.0f} s" if last is not None else f"a typical start, {each:.0f} s"
    side = min(cold, SIDE_BY_SIDE[kind_of(device)])
    waves = -(-cold // side)
    together = f", {side} at a time" if side > 1 else ""
    return waves * each, f"{cold} engine{'s' if cold != 1 else ''} to start{together} ({how})"


def _rough(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} minutes"


def _words(total: float, parts: list[str]) -> str:
    return f"About {_rough(total)} here: " + "; ".join(parts) + "."


# kind -> how many times its estimate the last run of that kind here took, where that was more than 2x:
# the next estimate of the kind is scaled by it (and says so) until a run lands within 2x again
_SLOWER: dict[tuple[str, str], float] = {}


def learned(kind: str, device: str, seconds: float, parts: list[str]) -> tuple[float, list[str]]:
    """An estimate scaled by what the last run of this kind here showed, when it ran over twice its estimate."""
    k = _SLOWER.get((kind, kind_of(device)))
    if not k:
        return seconds, parts
    return seconds * k, [*parts, f"times {k:.1f}: the last such run here took {k:.1f}x its estimate"]


def judged(kind: str, device: str, estimated_s: float | None, took_s: float) -> str | None:
    """After a run: the words a page shows when it took more than twice the estimate it showed
    beforehand (None when within 2x), and the next estimate of this kind learns the ratio."""
    if not estimated_s or estimated_s <= 0:
        return None
    key = (kind, kind_of(device))
    base = estimated_s / _SLOWER.get(key, 1.0)  # the estimate before any earlier scaling
    ratio = took_s / estimated_s
    if ratio <= 2:
        if key in _SLOWER and took_s / base <= 2:
            _SLOWER.pop(key)  # back within 2x of the plain estimate: no scaling any more
        return None
    _SLOWER[key] = took_s / base
    return (
        f"This run took {_rough(took_s)}, {ratio:.1f}x the {_rough(estimated_s)} estimated before it started "
        "(a busy machine, or more engines to start than expected). The next estimate here counts it."
    )


def rollout_estimate(
    device: str,
    n_prompts: int,
    samples: int,
    max_tokens: int,
    n_dtypes: int,
    floors: bool,
    cold: int,
    in_turn_weights: int = 0,
) -> tuple[float, str]:
    """(seconds, the words a form shows) of a rollout before it starts. in_turn_weights: the weight
    bytes of a model whose engines take turns under the cap (each dtype: vLLM's turn, HF's, and with
    the floors one more of each)."""
    tokens = n_prompts * samples * max_tokens * max(1, n_dtypes)
    rate, src = _rate("rollout", device)
    work = tokens * rate
    parts = [f"up to {tokens:,} sampled tokens at {rate * 1000:.0f} ms each ({src})"]
    if floors:
        frate, fsrc = _rate("rollout_floors", device)
        work += tokens * frate
        parts.append(f"the noise floors, {frate * 1000:.0f} ms a token ({fsrc})")
    start, swords = _starts(cold, device)
    turn_s, twords = turns_estimate(device, (4 if floors else 2) * max(1, n_dtypes) if in_turn_weights else 0, in_turn_weights)
    total, parts = learned("rollout", device, work + start + turn_s, [*parts, swords, *([twords] if twords else [])])
    return total, _words(total, parts)


def rollout_words(device: str, n_prompts: int, samples: int, max_tokens: int, n_dtypes: int, floors: bool, cold: int) -> str:
    return rollout_estimate(device, n_prompts, samples, max_tokens, n_dtypes, floors, cold)[1]


def frontier_estimate(device: str, n_configs: int, cold: int, repeats: int = 3, in_turn_weights: int = 0) -> tuple[float, str]:
    """(seconds, the words a form shows) of a frontier before it starts: every engine start, and each
    configuration's accuracy and its speed timed `repeats` times. in_turn_weights: the weight bytes of
    a model whose engines take turns under the cap (each configuration: vLLM's turn, HF's and the
    float64 reference's)."""
    rate, src = _rate("frontier", device)
    start, swords = _starts(cold, device)
    turn_s, twords = turns_estimate(device, 3 * n_configs if in_turn_weights else 0, in_turn_weights)
    total, parts = learned(
        "frontier",
        device,
        n_configs * rate + start + turn_s,
        [
            f"{n_configs} configuration(s) at {rate:.0f} s each once warm, its speed timed {repeats} times ({src})",
            swords,
            *([twords] if twords else []),
        ],
    )
    return total, _words(total, parts)


def frontier_words(device: str, n_configs: int, cold: int, repeats: int = 3) -> str:
    return frontier_estimate(device, n_configs, cold, repeats)[1]


# Engines in turn (analysis.turns): one engine leaving the device and the other taking it. On a GPU
# the weights move to pinned host memory and back: 10.5 s for two turns of the Qwen3-30B-A3B shape's
# 46 GB on an H100 (benchmarks/results/turns_h100.md), about 0.115 s a GB (HF's first sleep copies its
# weights; later ones copy nothing). On a CPU an engine stops and another starts.
TURN_S_PER_GB = 0.115


def turns_estimate(device: str, turns: int, weight_bytes: int) -> tuple[float, str]:
    """(seconds, words) of `turns` engine turns of a model of `weight_bytes` (none: (0, ""))."""
    if turns <= 0:
        return 0.0, ""
    if kind_of(device) == "cuda":
        each = TURN_S_PER_GB * weight_bytes / 1e9
        how = f"each a sleep and a wake, about {each:.0f} s for {weight_bytes / 1e9:.0f} GB of weights"
    else:
        each, how = _starts(1, device)[0], "each an engine stopped and another started"
    return turns * each, f"{turns} turns of the engines ({how})"


def diagnostics_estimate(
    device: str, parts: list[str], n_dtypes: int, cold: int, ablation_engines: int, in_turn_weights: int = 0
) -> tuple[float, str, float]:
    """(seconds, words, of them the engine starts) of a diagnosis before it starts: every engine it starts (the comparison's not
    running, HF's other attention kernel a dtype for the noise part, HF in float64 for the reference,
    one vLLM engine a setting and dtype for the setting-by-setting part; the layers start none: their
    float64 reference runs in the HF engine, one layer at a time), and the checks' own work at
    the rate this server's last diagnosis measured (none yet: the words say so)."""
    starts = cold + (n_dtypes if "noise" in parts else 0) + (1 if "reference" in parts else 0)
    starts += ablation_engines if "ablation" in parts else 0
    start, swords = _starts(starts, device)
    key = ("diagnostics", kind_of(device))
    units = max(1, len(parts)) * max(1, n_dtypes)
    if key in _RATES:
        work, wwords = units * _RATES[key], f"{len(parts)} check(s) in {n_dtypes} dtype(s) at this server's last rate"
    else:
        work, wwords = 0.0, "plus the checks themselves (not yet timed here: the first diagnosis times them)"
    extra: list[str] = []
    if in_turn_weights:  # the engines take turns: the comparison's two, and two more a check and dtype
        t_s, twords = turns_estimate(device, 2 * n_dtypes * (1 + len(parts)), in_turn_weights)
        work += t_s
        extra.append(twords)
    total, words = learned("diagnostics", device, start + work, [swords, wwords, *extra])
    return total, _words(total, words), start


def cold_engines(pool: Any, model_path: str | None, wanted: list[tuple[str, str]], settings: Any = None) -> int:
    """How many of the (backend, dtype) engines a run needs are not running in the pool for this model.
    With `settings` (an EngineSettings), an engine counts as running only with the same settings for
    its backend: a rollout's eager vLLM engine is not the Compare page's, and counting it as running
    said "About 2 s" for a run of 18.7 s. Any context length counts (a close enough estimate)."""
    if model_path is None:
        return len(wanted)
    from logprob_parity.inputs.spec import canonical_json

    running = set()
    for key in pool.engine_keys():
        try:
            k = json.loads(key)
        except ValueError:
            continue
        if k.get("model_path") != model_path:
            continue
        if settings is not None:
            own = settings.hf_part() if k.get("backend") in ("hf", "hf_null") else settings.vllm_part()
            if canonical_json(k.get("settings")) != canonical_json(own):
                continue
        running.add((k.get("backend"), k.get("dtype")))
    return sum(1 for w in wanted if w not in running)
