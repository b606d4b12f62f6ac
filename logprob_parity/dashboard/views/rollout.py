"""Rollout page: vLLM samples completions (its decode path, as an RL rollout does); vLLM prefill and
HF (the trainer) rescore the same tokens; every token compared three ways."""

import streamlit as st

from logprob_parity.dashboard.components.rollout_panel import (
    import_form,
    remember_computed,
    rollout_form,
    rollouts_from_query,
    run_rescore,
    run_rollout,
    show_rollouts,
)
from logprob_parity.dashboard.state import set_query

st.title("Rollout: vLLM's generation against the trainer")
st.caption(
    "In RL training, vLLM writes the text (a rollout) and a trainer rescores the same tokens. Do they agree? "
    "vLLM samples, then vLLM (prefill) and HF transformers rescore exactly those tokens. Hover a token for every number."
)
sample_tab, import_tab = st.tabs([":material/casino: Sample new rollouts", ":material/upload_file: Rescore logged rollouts"])
with sample_tab:
    spec, sampling, floors = rollout_form()
with import_tab:
    logged = import_form()
done = None
if spec is not None and sampling is not None:
    done = run_rollout(spec, sampling, floors)
elif logged is not None:
    done = run_rescore(*logged)
    spec = logged[3]
if done:
    remember_computed(done)
    set_query(rollout=",".join(r.rollout_id for r in done), sample=0)
ros = rollouts_from_query()
if ros:
    show_rollouts(ros)
elif spec is None:
    st.info(
        "Press Run to sample new rollouts on the embedded model, or Rescore to rescore your own logged rollouts; "
        "or open a stored rollout from the Runs page.",
        icon=":material/info:",
    )
