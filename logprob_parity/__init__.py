"""logprob-parity from Python: a notebook cell or a training loop, no dashboard needed.

    import logprob_parity as lp
    runs = lp.compare(["The capital of France is Paris."], dtypes=["float32", "bfloat16"])
    runs[1].summary["mean_abs_delta"]; runs[1].to_pandas()          # one row a position
    ro = lp.rescore("rollouts.jsonl", map="logprobs=rollout_log_probs")[0]
    ro.worst_tokens()                                               # the largest importance-ratio breaks
    gate = lp.check(runs, max_abs_delta=0.05); gate.passed
    lp.diff(runs[0], runs[1]).headline
    lp.layers("The capital of France is Paris.", dtypes="bfloat16")["bfloat16"]["words"]  # where they part
    lp.load("3f2a9c")                                               # any stored run, rollout or frontier

The same functions the console script and the pages call (logprob_parity.analysis.*), with plain keyword
arguments; every call stores its result as they do ($LOGPROB_PARITY_HOME) and returns the typed
records (Run, Rollout, CheckResult, RunDiff, FrontierResult), each with `.to_pandas()` where a table
makes sense.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Importing the package imports neither torch nor vLLM: every function below imports its stage lazily,
# and the engines load in their own host processes.
__version__ = "0.1.0"

__all__ = ["check", "compare", "diff", "layers", "load", "rescore", "rollout"]


def _spec(
    texts: str | Sequence[str],
    model: str | None,
    dtypes: str | Sequence[str],
    device: str,
    bos: str,
    settings: dict[str, Any] | None,
    **extra: Any,
) -> Any:
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec

    texts = (texts,) if isinstance(texts, str) else tuple(texts)
    dtypes = tuple(d.strip() for d in dtypes.split(",")) if isinstance(dtypes, str) else tuple(dtypes)
    spec = RunSpec(
        texts=texts, model=model, dtypes=dtypes, device=device, bos=bos, settings=EngineSettings(**(settings or {})), **extra
    )
    spec.validate()
    return spec


def _interactive() -> bool:
    """A person is watching: a terminal, Python's interactive prompt, or a notebook (IPython/Jupyter)."""
    import sys

    shell = sys.modules.get("IPython")
    return bool(
        hasattr(sys, "ps1") or sys.stderr.isatty() or (shell is not None and getattr(shell, "get_ipython", lambda: None)())
    )


def _ctx(home: str | None, progress: bool | None, ray: Any = None) -> Any:
    """`progress`: print each step (None: when a person is watching, so a four-minute rollout in a
    notebook says what it waits for; a script piped to a log stays quiet unless asked)."""
    if progress is None:
        progress = _interactive()
    from logprob_parity.analysis.request import Context
    from logprob_parity.inputs.models import model_roots_from_env
    from logprob_parity.results.store import Store

    def say(stage: str, dtype: str | None, detail: str) -> None:
        print(f"{stage}{f' [{dtype}]' if dtype else ''}: {detail}", flush=True)

    return Context.of(
        store=Store(home) if home else Store(),
        on_event=say if progress else None,
        model_roots=model_roots_from_env(),
        ray=ray,
    )


def compare(
    texts: str | Sequence[str],
    model: str | None = None,
    dtypes: str | Sequence[str] = ("float32",),
    *,
    device: str = "auto",
    top_k: int = 5,
    bos: str = "auto",
    settings: dict[str, Any] | None = None,
    noise_floor: bool = True,
    truncate: bool = False,
    use_cache: bool = True,
    home: str | None = None,
    progress: bool | None = None,
    ray: Any = None,
    null: bool = False,
) -> list[Any]:
    """Score `texts` with HF and vLLM on the same token ids: one stored Run per dtype. `settings`:
    engine settings by name (logprob_parity.inputs.settings), e.g. {"attention_backend": "FLEX_ATTENTION"}.
    `null`: HF against itself in vLLM's place (a text at a time against a padded micro-batch): what
    noise looks like, in the same numbers and verdict.
    `ray`: score the batches on a Ray cluster's workers: True (start Ray here), "auto", an address, or
    a dict of logprob_parity.analysis.cluster.RayOptions fields; the run is the one computed here."""
    from logprob_parity.analysis.compare import compare as _compare

    spec = _spec(texts, model, dtypes, device, bos, settings, top_k=top_k, noise_floor=noise_floor, truncate=truncate)
    spec = dataclasses.replace(spec, null=null)
    return _compare(spec, _ctx(home, progress, ray), use_cache=use_cache)


def layers(
    texts: str | Sequence[str],
    model: str | None = None,
    dtypes: str | Sequence[str] = ("float32",),
    *,
    text: int = 0,
    device: str = "auto",
    bos: str = "auto",
    settings: dict[str, Any] | None = None,
    home: str | None = None,
    progress: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Where in the network vLLM and HF part, per dtype: every decoder layer's attention and MLP outputs
    and residual stream on both engines for one of `texts` (the `text`-th), against HF's own noise and
    HF in float64 (logprob_parity.analysis.layers). Each value is the stored profile: "words" says it in
    a sentence, "per_layer" has a row per (layer, block), "vllm_vs_hf" the relative error per token. It
    is the layer part of a diagnosis (`diagnose --parts layers`), stored with it."""
    from logprob_parity.analysis.diagnostics import diagnose

    spec = _spec(texts, model, dtypes, device, bos, settings)
    result = diagnose(spec, _ctx(home, progress), parts=("layers",), layer_text=text)
    return {d: out.layers or {} for d, out in result.dtypes.items()}


def rollout(
    prompts: str | Sequence[str],
    model: str | None = None,
    dtypes: str | Sequence[str] = ("float32",),
    *,
    samples: int = 1,
    max_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int = 0,
    ignore_eos: bool = False,
    device: str = "auto",
    bos: str = "auto",
    settings: dict[str, Any] | None = None,
    noise_samples: int = 2,
    use_cache: bool = True,
    home: str | None = None,
    progress: bool | None = None,
    ray: Any = None,
) -> list[Any]:
    """Sample with vLLM's decode path and rescore with vLLM prefill and HF: one stored Rollout per dtype.
    `ray`: as `compare`'s (each worker samples its batch of prompts, as an RL cluster's workers do)."""
    from logprob_parity.analysis.rollout import rollout as _rollout
    from logprob_parity.results.rollout import Sampling

    spec = _spec(prompts, model, dtypes, device, bos, settings)
    sampling = Sampling(
        samples=samples,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    return _rollout(spec, sampling, _ctx(home, progress, ray), use_cache=use_cache, noise_samples=noise_samples)


def rescore(
    rollouts: str | Path | bytes,
    model: str | None = None,
    dtypes: str | Sequence[str] = ("float32",),
    *,
    map: str | dict[str, str] | None = None,
    name: str | None = None,
    device: str = "auto",
    bos: str = "auto",
    settings: dict[str, Any] | None = None,
    use_cache: bool = True,
    home: str | None = None,
    progress: bool | None = None,
    ray: Any = None,
) -> list[Any]:
    """Rescore logged rollouts (a JSONL/Parquet file, or its bytes with `name`) with vLLM prefill and
    HF; `map` renames fields ("logprobs=rollout_log_probs,..." or a dict). One stored Rollout per dtype.
    `ray`: as `compare`'s."""
    from logprob_parity.analysis.rescore import rescore as _rescore
    from logprob_parity.inputs.rollout_logs import parse_mapping

    if isinstance(rollouts, bytes):
        if not name:
            raise ValueError("rescore(bytes) needs name= (its file name: .jsonl, .parquet or .json)")
        data: bytes | Path = rollouts
    else:
        data = Path(rollouts)
        name = name or data.name
    mapping = map if isinstance(map, dict) else parse_mapping(map)
    spec = _spec(("logged rollouts",), model, dtypes, device, bos, settings)
    return _rescore(data, name, spec, _ctx(home, progress, ray), mapping=mapping, use_cache=use_cache)


def check(
    runs: Any,
    *,
    max_mean_abs_delta: float | None = None,
    max_abs_delta: float | None = None,
    max_kl_mean: float | None = None,
    min_argmax_agreement: float | None = None,
    max_routing_flip_frac: float | None = None,
    baseline: Any = None,
    max_worsening: float = 1.5,
    home: str | None = None,
) -> Any:
    """The parity gate: a CheckResult (`.passed`, `.lines()`, `.exit_code`, `.to_pandas()`). `runs`
    and `baseline` are Runs or stored run ids."""
    from logprob_parity.analysis.check import Bounds
    from logprob_parity.analysis.check import check as _check

    runs = [runs] if not isinstance(runs, (list, tuple)) else list(runs)
    runs = [load(r, home=home) if isinstance(r, str) else r for r in runs]
    if isinstance(baseline, str):
        baseline = load(baseline, home=home)
    bounds = Bounds(
        max_mean_abs_delta,
        max_abs_delta,
        max_kl_mean,
        min_argmax_agreement,
        max_routing_flip_frac=max_routing_flip_frac,
        max_worsening=max_worsening,
    )
    return _check(runs, bounds, baseline)


def diff(a: Any, b: Any, *, home: str | None = None) -> Any:
    """Two runs of the same model and token ids side by side: a RunDiff (`.headline`, `.changes`, `.to_pandas()`).
    Where each run has a diagnosis with a layer part, `.layers` sets their profiles side by side."""
    from logprob_parity.analysis.diff import diff_runs
    from logprob_parity.results.store import Store

    a = load(a, home=home) if isinstance(a, str) else a
    b = load(b, home=home) if isinstance(b, str) else b
    return diff_runs(a, b, store=Store(home) if home else Store())


def load(any_id: str, *, home: str | None = None) -> Any:
    """A stored run, rollout or frontier by its id (or a unique prefix of it)."""
    from logprob_parity.results.store import Store

    store = Store(home) if home else Store()
    if store.is_rollout(any_id):
        return store.load_rollout(any_id)
    if store.is_frontier(any_id):
        return store.load_frontier(store.resolve_frontier_id(any_id))
    from logprob_parity.analysis.verdict import with_verdict

    return with_verdict(store.load(any_id))  # a run stored before verdicts were gets its own now
