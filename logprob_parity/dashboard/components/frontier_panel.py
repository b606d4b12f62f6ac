"""The Frontier page's parts: its form and the display of a stored frontier."""

from __future__ import annotations

import json
import time

import streamlit as st

from logprob_parity.analysis.estimate import cold_engines, frontier_defaults, frontier_estimate, record
from logprob_parity.analysis.frontier import Config, default_grid, frontier, frontier_table, parse_configs, progress_steps
from logprob_parity.analysis.turns import in_turn_weights
from logprob_parity.dashboard.components.alerts import into_view_once, show_error
from logprob_parity.dashboard.components.model_field import chosen_model, model_inputs
from logprob_parity.dashboard.components.runner import run_job
from logprob_parity.dashboard.components.settings_form import setting_input
from logprob_parity.dashboard.state import device_here, engines_available, get_store, model_path_of, model_roots
from logprob_parity.engines.host import start_words
from logprob_parity.engines.pool import POOL
from logprob_parity.errors import UserError
from logprob_parity.inputs.prompts import SEED_TEXT
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.present.frontier_view import frontier_report_html, scatter

KEY = "frontier"


def frontier_form() -> tuple[RunSpec | None, list[Config] | None, float | None]:
    """The form, its defaults sized to the device (two configurations timed once on a CPU), with about
    how long a run will take here under it."""
    blocked = engines_available()
    device = device_here()
    grid = default_grid(device)
    runnable = [c.name for c in grid if not c.skip]
    d = frontier_defaults(device, runnable)
    with st.form(f"{KEY}-form"):
        c1, c2 = st.columns([3, 2])
        preset, typed = model_inputs(c1, KEY)
        tol = c2.number_input(
            "Tolerance: largest mean |Δ logp| to float64 (0: twice HF's own float32 gap, measured)",
            0.0,
            10.0,
            0.0,
            format="%.2e",
            key=f"{KEY}-tol",
        )
        text = st.text_area("Text", SEED_TEXT, key=f"{KEY}-text", height=80)
        chosen = st.multiselect(
            f"Configurations (each starts its own vLLM engine: {start_words('vllm', device)})",
            runnable,
            default=list(d.configs),
            key=f"{KEY}-configs",
        )
        extra = st.text_input(
            "More configurations: a dtype and setting=value pairs, ';' between them",
            key=f"{KEY}-extra",
            placeholder="float32 attention_backend=FLEX_ATTENTION; bfloat16 checkpoint=/path/to/its-gptq-checkpoint",
        )
        cap = setting_input(st, "device_memory", KEY)
        submitted = st.form_submit_button("Run", type="primary", disabled=blocked is not None)
    picked = [c for c in grid if c.name in chosen]
    wanted = [("hf", "float64")] + sorted({(b, c.dtype) for c in picked if not c.changes for b in ("hf", "vllm")})
    cold = cold_engines(POOL, model_path_of(chosen_model(preset, typed)), wanted, EngineSettings()) + sum(
        1 for c in picked if c.changes
    )
    weights = in_turn_weights(chosen_model(preset, typed), sorted({c.dtype for c in picked}), cap, model_roots())
    seconds, words = frontier_estimate(device, len(picked), cold, d.repeats, weights)
    st.session_state[f"{KEY}-estimate"] = seconds  # run_frontier says so when the run takes over twice this
    st.caption(":material/schedule: " + words)
    skipped = [c for c in grid if c.skip]
    if skipped:
        st.caption("Not measured here: " + "; ".join(f"{c.name} ({c.skip})" for c in skipped))
    if blocked:
        st.info(blocked)
    if not submitted:
        return None, None, None
    model = chosen_model(preset, typed)
    try:
        configs = [c for c in grid if c.name in chosen] + (parse_configs(extra) if extra.strip() else [])
        if not configs:
            raise UserError("Choose at least one configuration.")
        spec = RunSpec(texts=(text,), model=model, settings=EngineSettings(device_memory=cap))
        spec.validate()
    except UserError as exc:
        show_error(str(exc))
        return None, None, None
    return spec, configs, (tol or None)


def run_frontier(spec: RunSpec, configs: list[Config], tolerance: float | None):
    device = device_here()
    d = frontier_defaults(device, [])
    t0 = time.monotonic()
    done = run_job(
        lambda ctx: frontier(spec, configs, ctx, tolerance, speed_load=d.speed_load, repeats=d.repeats),
        "Measuring each configuration",
        progress_steps(len(configs), d.repeats),
        clear="frontier",
        model=spec.model,
        estimate=("frontier", st.session_state.get(f"{KEY}-estimate") or 0.0),
    )
    if done is not None:  # this server's own rate, engine starts left out, for the next estimate
        ran = [c for c in done.configs if not c["skipped"]]
        starts = sum(c.get("start_s") or 0.0 for c in ran)
        record("frontier", device, time.monotonic() - t0 - starts, len(ran))
    return done


@st.cache_resource(max_entries=16)
def load_frontier(frontier_id: str):
    return get_store().load_frontier(frontier_id)


def frontier_from_query():
    fid = st.query_params.get("frontier")
    if not fid:
        return None
    try:
        return load_frontier(get_store().resolve_frontier_id(fid))
    except UserError as exc:
        st.warning(str(exc), icon=":material/warning:")
        return None


def show_frontier(result) -> None:
    into_view_once("frontier:" + result.frontier_id)  # a new result, or a share link
    rec = result.recommendation
    if rec.get("name"):
        st.success(f"**Recommended: {rec['name']}.** It is {rec['why']}.", icon=":material/recommend:")
    else:
        st.warning(f"**No recommendation.** {rec['why']}.", icon=":material/warning:")
    skipped = [c for c in result.configs if c["skipped"]]
    if skipped:  # one box, each with its reason: a long grid's failures must not push the result off screen
        st.warning(
            f"**{len(skipped)} of {len(result.configs)} configurations did not run:**\n"
            + "\n".join(f"- **{c['name']}**: {c['skipped']}" for c in skipped),
            icon=":material/block:",
        )
    for c in result.configs:
        if (c["ref_gap"] or {}).get("kl_why"):
            st.info(f"**{c['name']}** has no exact KL: {c['ref_gap']['kl_why']}", icon=":material/info:")
    st.caption(
        f"{result.model} · {result.device} · "
        + " · ".join(f"{k} {v}" for k, v in result.versions.items() if v)
        + f" · {result.n_tokens} tokens · frontier `{result.frontier_id}`"
    )
    if any(not c["skipped"] for c in result.configs):
        st.altair_chart(scatter(result), width="stretch")
    # those that did not run are listed above, with why; short headers (the full words on hover) so every
    # column fits the page's width instead of running off its right edge
    table = [{k: v for k, v in r.items() if k != "skipped"} for r in frontier_table(result) if not r["skipped"]]
    for r in table:  # no start time (an engine that was already warm, or one stored before it): blank, not "None"
        r["engine start s"] = float("nan") if r.get("engine start s") is None else r["engine start s"]
    sci = {
        "mean |Δ logp| to float64": "mean |Δ|",
        "max": "max |Δ|",
        "exact KL to float64": "KL",
        "HF in that dtype: mean |Δ|": "HF |Δ|",
    }
    counts = {"prefill tokens/s": "prefill tok/s", "generate tokens/s": "gen tok/s", "KV bytes/token": "KV B/tok"}
    st.dataframe(
        table,
        hide_index=True,
        width="stretch",
        column_config={
            "configuration": st.column_config.TextColumn("configuration", width="medium"),
            **{k: st.column_config.NumberColumn(short, help=k, format="%.2e", width="small") for k, short in sci.items()},
            **{
                k: st.column_config.NumberColumn(short, help=k, format="localized", step=1, width="small")
                for k, short in counts.items()
            },
            "prefill spread": st.column_config.TextColumn("spread", help="prefill tokens/s, slowest to fastest repeat"),
            "weights GiB": st.column_config.NumberColumn("GiB", help="weights GiB", format="%.2f", width="small"),
            "engine start s": st.column_config.NumberColumn("start s", help="engine start s", format="%.1f", width="small"),
            "on the front": st.column_config.CheckboxColumn("front", help="on the Pareto front", width="small"),
        },
    )
    sp = result.speed or {}
    how = (
        f"Speed: each configuration's vLLM engine, warm, on {sp['load']} of this model, timed {sp['repeats']} times: the "
        "median, and the spread from the slowest to the fastest repeat; a configuration counts as faster only by more than "
        "that spread. "
        if sp
        else "Speed: measured on the text above (stored before speeds were measured on a load). "
    )
    st.caption(
        "Every configuration scored the same token ids; the reference is HF in float64. The exact KL sums over the "
        "whole vocabulary. " + how + "Prefill: scoring every token; generate: greedy tokens a second. Weights and KV "
        "bytes a token: what the engine holds on the device (FP8 halves them)."
    )
    c1, c2, _ = st.columns([1, 1, 4])
    c1.download_button(
        "HTML report",
        lambda: frontier_report_html(result),
        f"frontier-{result.frontier_id}.html",
        "text/html",
        icon=":material/download:",
        key="frontier-html",
    )
    c2.download_button(
        "JSON",
        lambda: json.dumps(result.to_dict(), indent=1, allow_nan=False),
        f"frontier-{result.frontier_id}.json",
        "application/json",
        icon=":material/download:",
        key="frontier-json",
    )
