"""Errors, progress and results a person sees without looking for them.

Why: a form on a 1400×900 screen ends near the bottom edge, so an error drawn under it (an empty text,
an unknown model) landed below the fold and Run seemed to do nothing. Every refusal goes through
`show_error`, which draws the message and scrolls it into view. The script is fixed text: the message
itself goes through Streamlit's own escaping in `st.error`, never into the HTML. The same holds for
what Run starts: its progress (`bring_into_view` as the job starts) and then its first result, or the
result a share link opens (`into_view_once`, once per result, so changing a view setting does not
jump the page back).
"""

from __future__ import annotations

from typing import Any

import streamlit as st

_COUNTER = "lpp-alert-counter"
# Scroll the marker placed right after the alert into view, once the alert is drawn above it.
_SCROLL = """<div id="lpp-{kind}-{n}" data-testid="lpp-{kind}-anchor"></div>
<script>
setTimeout(() => {{
  const mark = document.getElementById("lpp-{kind}-{n}");
  if (mark) mark.scrollIntoView({{block: "{block}", behavior: "instant"}});
}}, 150);
</script>"""
_SHOWN = "lpp-into-view-shown"


def show_error(message: str, where: Any = None) -> None:
    """Draw `message` as an error (in `where`, a placeholder, else at this point of the page) and bring
    it into view."""
    n = st.session_state.get(_COUNTER, 0) + 1
    st.session_state[_COUNTER] = n  # a new marker each time: the script runs again for every error
    box = where.container() if where is not None else st.container()
    with box:
        st.error(message, icon=":material/error:")
        st.html(_SCROLL.format(kind="alert", n=n, block="center"), unsafe_allow_javascript=True)


def bring_into_view(kind: str = "progress") -> None:
    """Scroll the page to this point now (a marker here; `kind` names it for tests: progress, result)."""
    n = st.session_state.get(_COUNTER, 0) + 1
    st.session_state[_COUNTER] = n
    st.html(_SCROLL.format(kind=kind, n=n, block="start"), unsafe_allow_javascript=True)


def into_view_once(key: str, slot: str = "result", scroll: bool = True) -> bool:
    """bring_into_view("result") the first time this result (`key`: its ids) is drawn in this session in
    this `slot` of a page: a new result, or a share link opened fresh; not again when a view setting
    redraws it. scroll=False only notes it as shown (it is already on screen). Whether it scrolled."""
    name = f"{_SHOWN}-{slot}"
    if st.session_state.get(name) == key:
        return False
    st.session_state[name] = key
    if scroll:
        bring_into_view("result")
    return scroll
