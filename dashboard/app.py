"""Entry point: `streamlit run dashboard/app.py` (or `logprob-parity dashboard`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="logprob-parity", page_icon="⚖️", layout="wide")

VIEWS = Path(__file__).resolve().parent / "views"
pages = [
    st.Page(VIEWS / "compare.py", title="Compare", icon="🔬", url_path="compare", default=True),
    st.Page(VIEWS / "prompt_set.py", title="Prompt set", icon="📚", url_path="prompt-set"),
    st.Page(VIEWS / "diagnostics.py", title="Diagnostics", icon="🩺", url_path="diagnostics"),
    st.Page(VIEWS / "runs.py", title="Runs", icon="🗂️", url_path="runs"),
]
st.navigation(pages).run()
