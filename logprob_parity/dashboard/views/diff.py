"""Diff page: two stored runs of the same model and token ids, side by side (reached from Runs)."""

import pandas as pd
import streamlit as st

from logprob_parity.analysis.diff import FACTOR, diff_runs, ratio_words
from logprob_parity.analysis.layers import BLOCK_WORDS
from logprob_parity.dashboard.components.alerts import show_error
from logprob_parity.dashboard.components.run_view import card_number, sci_columns
from logprob_parity.dashboard.state import get_store, load_run
from logprob_parity.errors import UserError

st.title("What changed between two runs")
st.caption(
    "The same model and the same tokens, scored twice (another vLLM version, device, dtype or setting): how far apart "
    "vLLM and HF were in each run, token by token, and what differs between the runs."
)
ids = [x for x in (st.query_params.get("diff") or "").split(",") if x]
if len(ids) != 2:
    st.info(
        "Pick two runs on the Runs page (tick one comparison with two dtypes, or two comparisons of the same texts) "
        "and press Diff.",
        icon=":material/info:",
    )
    st.stop()
try:
    a, b = load_run(ids[0]), load_run(ids[1])
    d = diff_runs(a, b, store=get_store())
except UserError as exc:
    show_error(str(exc))
    st.stop()
box = st.warning if d.mean_b > d.mean_a * 1.05 else (st.success if d.mean_b < d.mean_a / 1.05 else st.info)
box(f"**{d.headline}**", icon=":material/difference:")
c1, c2, c3 = st.columns(3)
c1.metric(f"mean gap, A ({d.dtypes[0]})", card_number(d.mean_a), help=f"exactly {d.mean_a!r}")
c2.metric(
    f"mean gap, B ({d.dtypes[1]})",
    card_number(d.mean_b),
    help=f"exactly {d.mean_b!r}; " + (f"{d.mean_b / d.mean_a:.3g} times A's" if d.mean_a > 0 else "A's mean gap is 0"),
)
c3.metric(
    f"tokens whose gap grew more than {FACTOR:g}x",
    f"{d.share_wider:.1%}",
    help=f"and {d.share_narrower:.1%} shrank more than {FACTOR:g}x",
)
st.markdown("**What differs between the runs** (from their stored records)")
if d.changes:
    st.dataframe(
        pd.DataFrame([{"what": w, "run A": str(x), "run B": str(y)} for w, x, y in d.changes]), hide_index=True, width="stretch"
    )
else:
    st.caption("Nothing recorded differs (the same versions, device and settings): the change is run-to-run noise.")
if d.layers:
    st.markdown(f"**Where in the network**: {d.layers.get('words') or d.layers.get('why')}")
    if d.layers.get("rows"):
        lay = (
            pd.DataFrame(d.layers["rows"])
            .assign(block=lambda f: f["block"].map(BLOCK_WORDS))
            .rename(columns={"median_a": "median error in A", "median_b": "median error in B", "ratio": "B / A"})
        )
        st.dataframe(lay, hide_index=True, width="stretch", column_config=sci_columns(lay, skip=("layer", "block", "B / A")))
st.markdown("**The tokens whose gap moved most**")
if d.movers:
    movers = pd.DataFrame([{**m, "ratio": ratio_words(m)} for m in d.movers])
    movers = movers.rename(columns={"gap_a": "gap in A", "gap_b": "gap in B", "ratio": "B / A"})
    st.dataframe(
        movers,
        hide_index=True,
        width="stretch",
        column_config=sci_columns(movers, skip=("prompt", "position", "token_id", "B / A")),
    )
else:
    st.info("No token moved: every token has the same gap in both runs.", icon=":material/equal:")
st.caption(
    f"A: run `{d.a}` · B: run `{d.b}` · {d.n_tokens:,} tokens scored in both. A gap is |Δ logp| between vLLM and HF "
    "at that token in that run."
)
