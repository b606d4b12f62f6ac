"""Deleting stored results from the Runs page: asked first, said after, and the selection cleared.

Why: Delete used to act at once, with no question and no message, and the table kept its ticks by row
number, so the row that moved up into the deleted one's place showed as selected. Each table's key
carries a generation that a delete bumps: the table after a delete is a new widget with no selection.
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from logprob_parity.dashboard.components.alerts import show_error
from logprob_parity.errors import UserError


def table_key(name: str) -> str:
    """The table's widget key, new after every delete from it."""
    return f"{name}-{st.session_state.get(f'{name}-generation', 0)}"


def delete_step(name: str, ids: list[str], what: str, delete: Callable[[str], None], button: str, container=None) -> None:
    """The Delete button of table `name` (ids selected; `what` names them in words), then a confirmation
    with both choices in view, then what happened, in words."""
    where = container or st
    pending = f"{name}-confirm"
    said = f"{name}-said"
    if st.session_state.get(said):
        st.success(st.session_state.pop(said), icon=":material/delete:")
    if where.button(button, disabled=not ids, icon=":material/delete:", key=f"{name}-delete"):
        st.session_state[pending] = list(ids)
        st.session_state[f"{pending}-what"] = what
    asked = st.session_state.get(pending)
    if not asked:
        return
    st.warning(f"Delete {st.session_state.get(f'{pending}-what', what)}? This cannot be undone.", icon=":material/warning:")
    yes, no = st.columns([1, 4])
    if no.button("Cancel", key=f"{name}-cancel"):
        st.session_state.pop(pending, None)
        st.rerun()
    if yes.button("Yes, delete", type="primary", key=f"{name}-yes"):
        gone, failed = [], []
        for rid in asked:
            try:
                delete(rid)
                gone.append(rid)
            except UserError as exc:
                failed.append(str(exc))
        st.session_state.pop(pending, None)
        st.session_state[f"{name}-generation"] = st.session_state.get(f"{name}-generation", 0) + 1
        if gone:
            st.session_state[said] = f"Deleted {st.session_state.pop(f'{pending}-what', what)} ({', '.join(gone)})."
        if failed:
            show_error("; ".join(failed))
            return
        st.rerun()
