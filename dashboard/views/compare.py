"""Compare page: one text, several dtypes, token by token."""

import streamlit as st

from dashboard.components.run_view import show_runs
from dashboard.components.runner import run_with_status
from dashboard.components.spec_form import spec_form
from dashboard.state import runs_from_query, set_query

st.title("vLLM vs HF log probabilities")
st.caption("Same model, same token ids, every token compared. Hover a token for both values, ranks and top-5 lists.")

spec, submitted = spec_form("compare", with_text=True)
if submitted and spec is not None:
    runs = run_with_status(spec)
    if runs:
        set_query(runs=",".join(r.run_id for r in runs), seq=0)

runs, problems = runs_from_query()
for p in problems:
    st.warning(p)
if runs:
    show_runs(runs, page="compare")
elif not submitted:
    st.info("Press Run to compare on the embedded model, or open a stored run from the Runs page.")
