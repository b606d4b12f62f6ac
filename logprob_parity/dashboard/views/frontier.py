"""Frontier page: accuracy against speed over dtypes, kernels and quantization, against HF float64."""

import streamlit as st

from logprob_parity.dashboard.components.frontier_panel import frontier_form, frontier_from_query, run_frontier, show_frontier
from logprob_parity.dashboard.state import set_query

st.title("Accuracy against speed")
st.caption(
    "Which engine configuration is both fast and accurate? Each one scores the same tokens; its error is measured "
    "against HF in float64, its speed in tokens a second. The recommendation is the fastest one within the tolerance."
)
spec, configs, tolerance = frontier_form()
if spec is not None and configs:
    done = run_frontier(spec, configs, tolerance)
    if done:
        set_query(frontier=done.frontier_id)
result = frontier_from_query()
if result is not None:
    show_frontier(result)
elif spec is None:
    st.info("Choose configurations and press Run, or open a stored frontier from the Runs page.", icon=":material/info:")
