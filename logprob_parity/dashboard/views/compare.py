"""Compare page: one text, several dtypes, token by token."""

import streamlit as st

from logprob_parity.analysis import prewarm
from logprob_parity.dashboard.components.run_view import show_runs
from logprob_parity.dashboard.components.runner import run_with_status
from logprob_parity.dashboard.components.spec_form import follow_view, mark_shown, spec_form
from logprob_parity.dashboard.state import current_runs, runs_from_query

st.title("vLLM vs HF log probabilities")
st.caption(
    "Do vLLM and Hugging Face transformers give the same probabilities to the same text? Same model, same "
    "tokens, every token compared. Press Run, then hover a token to see both engines' numbers."
)

warming = st.empty()  # engines started with the server, still loading: said here, cleared once loaded
if prewarm.status().words():
    warming.info(prewarm.status().words(), icon=":material/hourglass_top:")
follow_view("compare", runs_from_query()[0], with_text=True)  # the form shows what the view shows
spec, submitted = spec_form("compare", with_text=True)
just_run = run_with_status(spec) if submitted and spec is not None else None
if submitted and not prewarm.status().words():
    warming.empty()
if just_run:
    mark_shown("compare", just_run)
runs = current_runs(just_run)
if runs:
    show_runs(runs, page="compare")
elif not submitted:
    st.info("Press Run to compare on the embedded model, or open a stored run from the Runs page.", icon=":material/info:")
