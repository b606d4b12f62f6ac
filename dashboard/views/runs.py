"""Runs page: stored runs; open any without recomputing, or delete."""

import streamlit as st

from core.errors import UserError
from dashboard.state import get_store, load_run

st.title("Stored runs")
store = get_store()
df = store.list_runs()
if df.empty:
    st.info("No stored runs yet. Run a comparison on the Compare page.")
    st.stop()
st.caption(f"{len(df)} runs in {store.root}")
event = st.dataframe(df, hide_index=True, width="stretch", on_select="rerun", selection_mode="multi-row", key="runs-table",
                     column_config={"max_abs_delta": st.column_config.NumberColumn(format="%.3e"),
                                    "mean_abs_delta": st.column_config.NumberColumn(format="%.3e")})
selected = [df.iloc[i]["run_id"] for i in (event.selection.rows if event else [])]
c1, c2 = st.columns(2)
if c1.button("Open selected", disabled=not selected, type="primary"):
    st.switch_page("views/compare.py", query_params={"runs": ",".join(selected[:8]), "seq": "0"})
if c2.button("Delete selected", disabled=not selected):
    for rid in selected:
        try:
            store.delete(rid)
        except UserError as exc:
            st.error(str(exc))
    load_run.clear()
    st.rerun()
