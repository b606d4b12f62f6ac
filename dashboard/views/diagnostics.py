"""Diagnostics page: is the gap more than the noise, which knob moves it, who is closer to float64,
and does it change an answer?"""

import json

import altair as alt
import pandas as pd
import streamlit as st

from core.analysis.diagnostics import PARTS, biggest_knob, diagnose, diagnostics_tables
from core.errors import EngineError, UserError
from dashboard.components.run_view import verdict_cards
from dashboard.components.spec_form import spec_form
from dashboard.state import get_store, request_context, set_query

def sci(df: pd.DataFrame) -> dict:
    """Small numbers in scientific notation: 4e-06, not 0.000004."""
    return {c: st.column_config.NumberColumn(format="%.3e") for c in df.select_dtypes("number").columns}


st.title("Diagnostics")
st.caption(
    "Noise floor (HF against HF across batch size, padding and attention; vLLM alone vs batched and repeated), "
    "a float64 HF reference, greedy generation and multiple-choice answers from both engines, and an ablation "
    "of engine knobs. Everything runs on the same token ids as the comparison."
)
parts = st.multiselect("Diagnostics", PARTS, default=["noise", "reference", "downstream"], key="diag-parts",
                       help="ablation starts one vLLM engine per knob and dtype (about 40 s each on a CPU)")
spec, submitted = spec_form("diag", with_text=True)
if submitted and spec is not None:
    failed = None
    with st.status("Diagnosing…", expanded=True) as status:
        try:
            events = request_context(lambda stage, d, detail: status.update(label=f"{stage}{f' [{d}]' if d else ''}: {detail}"))
            result = diagnose(spec, events, parts=tuple(parts))
            status.update(label="Done", state="complete", expanded=False)
            set_query(diag=result.diagnostics_id)
        except (UserError, EngineError) as exc:
            status.update(label="Could not run", state="error", expanded=False)
            failed = exc
    if failed is not None:  # outside the collapsed status box: visible at once
        st.error(str(failed).splitlines()[0], icon=":material/error:")
        set_query(diag=None)  # an older result must not stay below as if it were this one

diag_id = st.query_params.get("diag")
result = None
if diag_id:
    try:
        result = get_store().load_diagnostics(diag_id)
    except UserError as exc:
        st.warning(str(exc))
if result:
    st.subheader(f"{result.model} · {result.device}")
    verdict_cards([out.verdict for out in result.dtypes.values()])
    tables = diagnostics_tables(result)
    if tables["noise"]:
        st.markdown("**Noise floor**: the vLLM–HF gap beside each engine's disagreement with itself (mean |Δ logp|)")
        df = pd.DataFrame(tables["noise"])
        st.dataframe(df, hide_index=True, width="stretch", column_config=sci(df))
        plot = df[df["source"] != "gap / HF's own noise"].assign(mean_abs=lambda d: d["mean_abs"].clip(lower=1e-10))
        st.altair_chart(
            alt.Chart(plot).mark_bar().encode(
                x=alt.X("mean_abs:Q", scale=alt.Scale(type="log"), title="mean |Δ logp| (0 drawn at 1e-10)"),
                y=alt.Y("source:N", title=None), color="dtype:N", yOffset="dtype:N",
                tooltip=["dtype", "source", alt.Tooltip("mean_abs:Q", format=".3e"), alt.Tooltip("max_abs:Q", format=".3e")],
            ),
            width="stretch",
        )
    if tables["reference"]:
        st.markdown("**High-precision reference** (HF in float64 on the CPU): which engine is closer to the truth")
        ref = pd.DataFrame(tables["reference"])
        st.dataframe(ref, hide_index=True, width="stretch", column_config=sci(ref))
    if tables["downstream"]:
        st.markdown("**Downstream impact**: greedy generation and multiple-choice answers (sum of option logprobs)")
        st.dataframe(pd.DataFrame(tables["downstream"]), hide_index=True, width="stretch")
        if result.mcq_dtype_flips:
            st.caption("Answer flips between dtypes: " + ", ".join(f"{k}: {v}" for k, v in result.mcq_dtype_flips.items()))
        for d, out in result.dtypes.items():
            g = out.greedy
            if g:
                with st.expander(f"Greedy continuations, {d}"):
                    st.text(f"HF:   {g['hf_text']!r}\nvLLM: {g['vllm_text']!r}")
    if tables["ablation"]:
        st.markdown("**Knob attribution**: the gap (mean |Δ logp|) with one setting changed")
        ab = pd.DataFrame(tables["ablation"])
        st.dataframe(ab.drop(columns=["run_id"]), hide_index=True, width="stretch", column_config=sci(ab))
        knob = biggest_knob(tables["ablation"])
        if knob:
            st.info(f"The knob that moves the gap most: {knob['knob']} ({knob['dtype']}, mean |Δ| {knob['change']:+.3e})")
        tried = ab.dropna(subset=["mean_abs_delta"])
        st.altair_chart(
            alt.Chart(tried).mark_bar().encode(x=alt.X("mean_abs_delta:Q", title="mean |Δ logp|"), y=alt.Y("knob:N", title=None),
                                               color="dtype:N", yOffset="dtype:N"),
            width="stretch",
        )
    st.download_button("Diagnostics JSON", json.dumps(result.to_dict(), indent=1, allow_nan=False), f"diagnostics-{result.diagnostics_id}.json",
                       "application/json")
