"""Compare page: one text, several dtypes, token by token."""

import streamlit as st

from dashboard.components.run_view import show_runs
from dashboard.components.runner import run_with_status
from dashboard.components.spec_form import spec_form
from dashboard.state import current_runs

st.title("vLLM vs HF log probabilities")
st.caption("Same model, same token ids, every token compared. Hover a token for both values, ranks and top-5 lists.")

spec, submitted = spec_form("compare", with_text=True)
runs = current_runs(run_with_status(spec) if submitted and spec is not None else None)
if runs:
    show_runs(runs, page="compare")
elif not submitted:
    st.info("Press Run to compare on the embedded model, or open a stored run from the Runs page.")
