"""Entry point: `streamlit run logprob_parity/dashboard/app.py` (or `logprob-parity dashboard`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

st.set_page_config(page_title="logprob-parity", page_icon=":material/balance:", layout="wide")

VIEWS = Path(__file__).resolve().parent / "views"
pages = [
    st.Page(VIEWS / "compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare", default=True),
    st.Page(VIEWS / "prompt_set.py", title="Prompt set", icon=":material/library_books:", url_path="prompt-set"),
    st.Page(VIEWS / "rollout.py", title="Rollout", icon=":material/model_training:", url_path="rollout"),
    st.Page(VIEWS / "frontier.py", title="Frontier", icon=":material/speed:", url_path="frontier"),
    st.Page(VIEWS / "diagnostics.py", title="Diagnostics", icon=":material/stethoscope:", url_path="diagnostics"),
    st.Page(VIEWS / "runs.py", title="Runs", icon=":material/folder_open:", url_path="runs"),
    st.Page(VIEWS / "diff.py", title="Diff", icon=":material/difference:", url_path="diff"),
]
st.navigation(pages).run()
