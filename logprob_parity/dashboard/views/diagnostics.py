"""Diagnostics page: is the gap more than the noise, which setting moves it, who is closer to float64,
and does it change an answer?"""

import contextlib
import json
import time

import altair as alt
import pandas as pd
import streamlit as st

from logprob_parity.analysis.diagnostics import (
    MEAN,
    PARTS,
    ablation_knobs,
    ablation_table,
    diagnose,
    diagnostics_tables,
    knob_lines,
)
from logprob_parity.analysis.estimate import cold_engines, diagnostics_estimate, record
from logprob_parity.analysis.turns import in_turn_weights
from logprob_parity.analysis.verdict import diagnosis_verdicts
from logprob_parity.dashboard.components.alerts import into_view_once
from logprob_parity.dashboard.components.model_field import DEMO_LABEL, chosen_model
from logprob_parity.dashboard.components.run_view import GLOSSARY, verdict_cards
from logprob_parity.dashboard.components.runner import run_job
from logprob_parity.dashboard.components.spec_form import follow_view, mark_shown, spec_form
from logprob_parity.dashboard.state import device_here, get_store, load_run, model_path_of, model_roots, set_query
from logprob_parity.engines.pool import POOL
from logprob_parity.errors import UserError
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import DTYPES
from logprob_parity.present.layers_view import block_choices, heat_frame, heat_map, line_chart, line_frame
from logprob_parity.present.palette import dtype_color_encoding

PART_WORDS = {
    "noise": "noise floor: HF and vLLM each against themselves",
    "reference": "float64 reference: which engine is closer to the exact answer",
    "downstream": "downstream: generated text and multiple-choice answers",
    "ablation": "setting by setting: which engine setting moves the gap (slow: one engine per setting)",
    "layers": "where in the network: the layer and block where vLLM and HF part (the first text)",
}
SHARE_COLUMNS = ("share of tokens where vLLM is closer", "share correct, HF", "share correct, vLLM", "share of the gap removed")


def columns(df: pd.DataFrame) -> dict:
    """Gaps in e-notation (4.000e-06, not 0.000004); shares as percentages; ratios as 345×."""
    cfg = {}
    for c in df.select_dtypes("number").columns:
        if c in SHARE_COLUMNS:
            cfg[c] = st.column_config.NumberColumn(c, format="percent")
        elif "÷" in c:
            cfg[c] = st.column_config.NumberColumn(c, format="%.3g×")
        else:
            cfg[c] = st.column_config.NumberColumn(c, format="%.3e")
    return cfg


def log_bars(df: pd.DataFrame, value: str, label: str, title: str) -> alt.Chart:
    """Horizontal bars on a log axis: each bar starts at a floor below the smallest value (a log axis
    has no zero, so bars from 0 are not drawn at all); exact zeros sit on that floor."""
    positive = df[value][df[value] > 0]
    floor = float(positive.min()) / 10 if len(positive) else 1e-10
    plot = df.assign(shown=df[value].clip(lower=floor), base=floor)
    return (
        alt.Chart(plot)
        .mark_bar()
        .encode(
            x=alt.X("shown:Q", scale=alt.Scale(type="log"), title=title, axis=alt.Axis(format=".0e")),
            x2="base:Q",
            y=alt.Y(f"{label}:N", title=None, sort=None, axis=alt.Axis(labelLimit=420)),
            color=dtype_color_encoding(plot["dtype"]),
            yOffset="dtype:N",
            tooltip=["dtype", label, alt.Tooltip(f"{value}:Q", format=".3e")],
        )
    )


st.title("Diagnostics")
st.caption(
    "Is the gap real? Each check runs on the same tokens as the comparison: how much each engine disagrees "
    "with itself (the noise floor), which engine is closer to an exact float64 answer, whether generated text or "
    "multiple-choice answers change, and which engine setting moves the gap."
)
diag_id = st.query_params.get("diag")
result = None
if diag_id:
    try:
        result = get_store().load_diagnostics(diag_id)
    except UserError as exc:
        st.warning(str(exc), icon=":material/warning:")
if result is not None:  # the form shows what the page shows
    with contextlib.suppress(UserError):  # its runs were deleted; the diagnosis itself still shows
        follow_view("diag", [load_run(r) for r in result.run_ids.values()], with_text=True)
parts = st.multiselect(
    "Checks to run",
    PARTS,
    default=["noise", "reference", "downstream"],
    key="diag-parts",
    format_func=PART_WORDS.get,
    help="The setting-by-setting check starts one vLLM engine per setting and dtype (about 40 s each on a CPU).",
)
# its own noise check is a part above; HF against itself leaves no vLLM gap to explain
spec, submitted = spec_form("diag", with_text=True, noise_choice=False, null_choice=False)
# how long, said before Run (the form's choices as they stand): every engine start counted
picked = [d for d in DTYPES if st.session_state.get(f"diag-dt-{d}")] or ["float32"]
model_now = chosen_model(st.session_state.get("diag-preset", DEMO_LABEL), st.session_state.get("diag-custom", ""))
wanted = [(b, d) for d in picked for b in ("hf", "vllm")]
cold = cold_engines(POOL, model_path_of(model_now), wanted, EngineSettings())
# the setting-by-setting part starts one engine a setting it runs here (a skipped one starts none)
knobs = sum(1 for _, change, _ in ablation_knobs(device_here(), False) if change is not None) * len(picked)
est_s, est_words, est_starts = diagnostics_estimate(
    device_here(),
    list(parts),
    len(picked),
    cold,
    knobs,
    in_turn_weights(model_now, picked, st.session_state.get("diag-set-device_memory"), model_roots()),
)
st.caption(":material/schedule: " + est_words)
if submitted and spec is not None:
    steps = (3 + 4 * len(parts)) * max(1, len(spec.dtypes))
    t_diag = time.monotonic()
    done = run_job(
        lambda ctx: diagnose(spec, ctx, parts=tuple(parts)),
        "Diagnosing",
        steps,
        clear="diag",
        model=spec.model,
        estimate=("diagnostics", est_s),
    )
    if done is not None:
        record("diagnostics", device_here(), time.monotonic() - t_diag - est_starts, len(parts) * len(spec.dtypes))
        set_query(diag=done.diagnostics_id)
        mark_shown("diag", [load_run(r) for r in done.run_ids.values()])
        result = done
    else:
        result = None  # the error above is the answer; an older diagnosis must not stay below it

if result:
    into_view_once("diag:" + ",".join(result.run_ids.values()))  # a new result, or a share link
    st.subheader(f"Result: {result.model} · {result.device}")
    verdict_cards(list(diagnosis_verdicts(result).values()))
    with st.expander("What do these words mean?", icon=":material/help:"):
        st.markdown(GLOSSARY)
    tables = diagnostics_tables(result)
    if tables["noise"]:
        st.markdown(
            "**Noise floor**: the gap between vLLM and HF beside HF's disagreement with itself when only what a "
            "trainer changes from step to step changes (micro-batch, padding side, packing, chunking through its KV "
            "cache: the rows marked *in the floor*; the others are shown beside it). A gap far above HF's own floor "
            "is systematic: it has a cause."
        )
        cols = st.columns(len(tables["ratios"]))
        for col, row in zip(cols, tables["ratios"]):
            r = row["gap ÷ HF's own noise"]
            col.metric(
                f"{row['dtype']}: the gap is",
                "–" if r is None else f"{r:.3g}× HF's own noise",
                help="The mean gap between the engines divided by HF's floor: the largest mean gap HF shows against "
                "itself across the floor's variations.",
            )
            words = (result.dtypes[row["dtype"]].floor or {}).get("noise_words")
            if words:
                col.caption(f"Floor set by: {words}.")
        df = pd.DataFrame(tables["noise"])
        st.dataframe(df, hide_index=True, width="stretch", column_config=columns(df))
        st.altair_chart(log_bars(df, MEAN, "what", "mean |Δ logp| (log scale)"), width="stretch")
    if tables["reference"]:
        st.markdown("**High-precision reference** (HF in float64 on the CPU): which engine is closer to the exact answer")
        ref = pd.DataFrame(tables["reference"])
        st.dataframe(ref, hide_index=True, width="stretch", column_config=columns(ref))
    layered = {d: out.layers for d, out in result.dtypes.items() if out.layers}
    if layered:
        st.markdown(
            "**Where in the network**: every layer's attention output, MLP output and residual stream, captured on both "
            "engines for the same tokens. Each cell is how far vLLM's vector is from HF's (relative error); a black outline marks a "
            "token that moved more than HF moves it against itself (its floor: the text batched beside others, packed after "
            "them, and fed through its cache in chunks) and more than rounding to the dtype alone can move it; a red outline "
            "marks a token whose router picked other experts at that layer."
        )
    for d, prof in layered.items():
        if "why" in prof:
            st.warning(f"{d}: the layer part did not run: {prof['why']}", icon=":material/warning:")
            continue
        st.markdown(f"**{d}**: {prof['words']}")
        names = block_choices(prof)
        block = (
            st.segmented_control(
                "Block", list(names), default="resid", format_func=names.get, key=f"layers-block-{d}", selection_mode="single"
            )
            or "resid"
        )
        pieces = None  # the run's token texts label the cells, where the run is still stored
        with contextlib.suppress(UserError, IndexError):
            pieces = list(load_run(result.run_ids[d]).sequences[prof.get("text", 0)].pieces)
        heat = heat_frame(prof, block, pieces)
        st.altair_chart(heat_map(heat, f"{d}: vLLM against HF, {names[block]}, layer by token"), width="stretch")
        st.altair_chart(line_chart(line_frame(prof, block), f"{d}: median over the text's tokens, by layer"), width="stretch")
        with st.expander(f"Layer by layer in numbers, {d}", icon=":material/table:"):
            lt = pd.DataFrame([r for r in tables["layers"] if r["dtype"] == d])
            st.dataframe(lt, hide_index=True, width="stretch", column_config=columns(lt))
    if tables["downstream"]:
        st.markdown(
            "**Downstream**: do the engines generate the same text, and pick the same multiple-choice answers "
            "(scored as the sum of each option's logprobs)?"
        )
        down = pd.DataFrame(tables["downstream"])
        st.dataframe(down, hide_index=True, width="stretch", column_config=columns(down))
        if result.mcq_dtype_flips:
            st.caption("Answers that change between dtypes: " + ", ".join(f"{k}: {v}" for k, v in result.mcq_dtype_flips.items()))
        for d, out in result.dtypes.items():
            g = out.greedy
            if g:
                with st.expander(f"Generated text, {d}"):
                    st.text(f"HF:   {g['hf_text']!r}\nvLLM: {g['vllm_text']!r}")
    if tables["ablation"]:
        st.markdown("**Setting by setting**: the gap (mean |Δ logp|) with one engine setting changed")
        st.markdown("\n".join(f"- {line}" for line in knob_lines(list(result.ablation))))
        ab = pd.DataFrame(ablation_table(tables["ablation"]))
        st.dataframe(ab, hide_index=True, width="stretch", column_config=columns(ab))
        tried = ab.dropna(subset=[MEAN])
        if not tried.empty:
            st.altair_chart(
                log_bars(tried, MEAN, "setting changed", "mean |Δ logp| with the setting changed (log scale)"), width="stretch"
            )
    st.download_button(
        "Diagnostics JSON",
        json.dumps(result.to_dict(), indent=1, allow_nan=False),
        f"diagnostics-{result.diagnostics_id}.json",
        "application/json",
        icon=":material/download:",
    )
elif not submitted:
    st.info("Choose the checks and press Run, or open stored diagnostics from the Runs page.", icon=":material/info:")
