"""Shared, cached handles: the store, loaded runs, what this machine can run, and URL state."""

from __future__ import annotations

import importlib.util
from typing import Any

import streamlit as st

from logprob_parity.analysis.request import Context
from logprob_parity.env import dtype_support, resolve_device
from logprob_parity.errors import UserError
from logprob_parity.inputs.models import model_roots_from_env
from logprob_parity.present.render import SCALES
from logprob_parity.results.run import Run
from logprob_parity.results.store import Store


@st.cache_resource
def get_store() -> Store:
    return Store()


@st.cache_resource(max_entries=64)
def load_run(run_id: str) -> Run:
    """Runs are content-addressed and immutable, so one loaded copy is shared by every session."""
    return get_store().load(run_id)


@st.cache_data(max_entries=32, show_spinner="Reading each prompt's verdict…")
def prompt_levels(run_ids: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each prompt's verdict title in each run (the Prompt set table's verdict column): runs are
    immutable, so read once for every session."""
    from logprob_parity.analysis.verdict import every_prompt_verdict

    runs = [load_run(r) for r in run_ids]
    diag = get_store().diagnostics_for_run(run_ids[0])
    return [tuple(v.title for v in vs) for vs in every_prompt_verdict(runs, diag)]


def engines_available() -> str | None:
    """None when both engines can run here, else why not (viewer mode)."""
    missing = [name for name in ("torch", "transformers", "vllm") if importlib.util.find_spec(name) is None]
    return f"viewer mode: {', '.join(missing)} not installed here; stored runs and shared links still open" if missing else None


LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")


def model_roots() -> list[str] | None:
    """Where local model folders may come from: anywhere when served on localhost; when served
    beyond it, only LPP_MODEL_ROOTS (none if unset), so visitors cannot load arbitrary paths."""
    roots = model_roots_from_env()
    address = st.get_option("server.address")
    if roots is None and address and address not in LOCAL_ADDRESSES:
        return []
    return roots


def request_context(on_event=None, on_progress=None) -> Context:
    """The context every page runs engines with: this server's store and its model-root rules."""
    return Context.of(store=get_store(), on_event=on_event, model_roots=model_roots(), on_progress=on_progress)


def device_here() -> str:
    """The device runs here use ("cpu" where the GPU check fails: the forms size their defaults by it)."""
    try:
        return resolve_device("auto")
    except UserError:
        return "cpu"


def model_path_of(model: str | None) -> str | None:
    """The folder a form's model names, for the time estimate (None for a Hub id: not known before it
    is resolved, so its engines count as not running)."""
    import os

    from logprob_parity.inputs.demo import demo_dir, is_demo

    if is_demo(model):
        return str(demo_dir())
    expanded = os.path.expanduser(model or "")
    return os.path.abspath(expanded) if os.path.isdir(expanded) else None


def dtype_reasons(device: str = "auto") -> dict[str, str | None]:
    try:
        dev = resolve_device(device)
    except UserError as exc:
        return {d: str(exc) for d in ("float16", "bfloat16", "float32")}
    return {d: dtype_support(d, dev) for d in ("float16", "bfloat16", "float32")}


COMPUTED_KEY = "lpp-computed-now"  # run id -> seconds, for runs this browser session computed


def runs_from_query() -> tuple[list[Run], list[str]]:
    """The runs named in ?runs=a,b; unknown or malformed ids become messages, not crashes."""
    raw = st.query_params.get("runs", "")
    runs, problems = [], []
    for rid in [r for r in raw.split(",") if r][:8]:
        try:
            runs.append(load_run(get_store().resolve_id(rid.strip())))
        except UserError as exc:
            problems.append(str(exc))
    return runs, problems


def current_runs(just_run: list[Run] | None = None) -> list[Run]:
    """Point the URL at runs just computed, then show whatever the URL names (warning on bad ids)."""
    if just_run:
        set_query(runs=",".join(r.run_id for r in just_run), seq=0)
        computed = st.session_state.setdefault(COMPUTED_KEY, {})
        for r in just_run:
            if not r.from_store:  # remembered for this session's reruns, which reopen it from the store
                computed[r.run_id] = r.meta.timing.get("total_s")
    runs, problems = runs_from_query()
    for p in problems:
        st.warning(p)
    return runs


def query_int(name: str, default: int, lo: int, hi: int) -> int:
    try:
        return min(max(int(st.query_params.get(name, default)), lo), hi)
    except (TypeError, ValueError):
        return default


def query_float(name: str, default: float | None) -> float | None:
    try:
        v = st.query_params.get(name)
        return float(v) if v not in (None, "") else default
    except (TypeError, ValueError):
        return default


def query_metric() -> str:
    m = st.query_params.get("metric", "abs_delta")
    return m if m in SCALES else "abs_delta"


def set_query(**values: Any) -> None:
    for k, v in values.items():
        if v is None:
            st.query_params.pop(k, None)
        else:
            st.query_params[k] = str(v)
