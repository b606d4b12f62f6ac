"""Runs page: stored comparisons and diagnostics; open any without recomputing, or delete runs."""

import streamlit as st

from core.errors import UserError
from dashboard.state import get_store, load_run

st.title("Stored runs")
store = get_store()
df = store.list_runs()
diags = store.list_diagnostics()
if df.empty and diags.empty:
    st.info("No stored runs yet. Run a comparison on the Compare page.", icon=":material/info:")
    st.stop()

if not df.empty:
    st.caption(f"{len(df)} runs in {store.root}. Each row is one dtype of a comparison.")
    shown = df[["first_text", "model", "dtype", "created", "n_tokens", "max_abs_delta", "mean_abs_delta", "run_id"]]
    st.dataframe(shown, hide_index=True, width="stretch",
                 column_config={"first_text": st.column_config.TextColumn("text", width="large"),
                                "max_abs_delta": st.column_config.NumberColumn("max |Δ logp|", format="%.3e"),
                                "mean_abs_delta": st.column_config.NumberColumn("mean |Δ logp|", format="%.3e"),
                                "run_id": st.column_config.TextColumn("run id")})
    labels = {r.run_id: f"{r.first_text[:48]} · {r.model} · {r.dtype} · {r.run_id[:8]}" for r in df.itertuples()}
    selected = st.multiselect("Runs to open together, or to delete", list(labels), format_func=labels.get, key="runs-pick",
                              max_selections=8)
    c1, c2 = st.columns(2)
    if c1.button("Open selected", disabled=not selected, type="primary", icon=":material/open_in_new:"):
        st.switch_page("views/compare.py", query_params={"runs": ",".join(selected), "seq": "0"})
    if c2.button("Delete selected", disabled=not selected, icon=":material/delete:"):
        for rid in selected:
            try:
                store.delete(rid)
            except UserError as exc:
                st.error(str(exc), icon=":material/error:")
        load_run.clear()
        st.session_state.pop("runs-pick", None)
        st.rerun()

if not diags.empty:
    st.subheader("Diagnostics")
    st.dataframe(diags[["first_text", "model", "dtypes", "parts", "created", "diagnostics_id"]], hide_index=True, width="stretch",
                 column_config={"first_text": st.column_config.TextColumn("text", width="large")})
    dlabels = {r.diagnostics_id: f"{r.first_text[:48]} · {r.model} · {r.dtypes} · {r.diagnostics_id[:8]}" for r in diags.itertuples()}
    pick = st.selectbox("Diagnostics to open", list(dlabels), format_func=dlabels.get, key="diag-pick")
    if st.button("Open diagnostics", icon=":material/stethoscope:"):
        st.switch_page("views/diagnostics.py", query_params={"diag": pick})
