"""Errors a person sees without looking for them.

Why: a form on a 1400×900 screen ends near the bottom edge, so an error drawn under it (an empty text,
an unknown model) landed below the fold and Run seemed to do nothing. Every refusal goes through
`show_error`, which draws the message and scrolls it into view. The script is fixed text: the message
itself goes through Streamlit's own escaping in `st.error`, never into the HTML.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

_COUNTER = "lpp-alert-counter"
# Scroll the marker placed right after the alert into view, once the alert is drawn above it.
_SCROLL = """<div id="lpp-alert-{n}" data-testid="lpp-alert-anchor"></div>
<script>
setTimeout(() => {{
  const mark = document.getElementById("lpp-alert-{n}");
  if (mark) mark.scrollIntoView({{block: "center", behavior: "instant"}});
}}, 150);
</script>"""


def show_error(message: str, where: Any = None) -> None:
    """Draw `message` as an error (in `where`, a placeholder, else at this point of the page) and bring
    it into view."""
    n = st.session_state.get(_COUNTER, 0) + 1
    st.session_state[_COUNTER] = n  # a new marker each time: the script runs again for every error
    box = where.container() if where is not None else st.container()
    with box:
        st.error(message, icon=":material/error:")
        st.html(_SCROLL.format(n=n), unsafe_allow_javascript=True)
