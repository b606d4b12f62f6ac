"""Prompt-set page: many prompts at once, aggregates per dtype, open any prompt in the token view."""

from dataclasses import replace

import pandas as pd
import streamlit as st

from logprob_parity.analysis.verdict import run_verdicts
from logprob_parity.dashboard.components.alerts import into_view_once, show_error
from logprob_parity.dashboard.components.run_view import sci_columns, show_runs, verdict_cards
from logprob_parity.dashboard.components.runner import run_with_status
from logprob_parity.dashboard.components.spec_form import follow_view, mark_shown, spec_form
from logprob_parity.dashboard.components.tables import picked_rows
from logprob_parity.dashboard.state import current_runs, get_store, prompt_levels, query_int, runs_from_query, set_query
from logprob_parity.errors import UserError
from logprob_parity.inputs.prompts import MAX_UPLOAD_BYTES, parse_prompts, sample_set
from logprob_parity.present.labels import summary_label, summary_value

st.title("Prompt set")
st.caption("Many texts at once: the same comparison for each, a summary over all of them, and any one opened token by token.")
upload = st.file_uploader(
    f'Prompts: .txt (one a line), .jsonl ({{"text": ...}}) or .csv (a text column), up to {MAX_UPLOAD_BYTES >> 20} MiB',
    type=["txt", "jsonl", "csv"],
    key="ps-upload",
)
texts = None
SAMPLE = "sentences.txt"  # the bundled sample set: ten short English sentences, the demo's own
sample = st.button(
    "Try the bundled sample set (10 sentences)",
    icon=":material/playlist_add:",
    key="ps-sample",
    help="Runs the comparison on the sample set shipped with the package, no upload needed.",
)
if sample:
    st.session_state["ps-use-sample"] = True
if upload is not None:
    st.session_state["ps-use-sample"] = False
if st.session_state.get("ps-use-sample") and upload is None:
    pset = sample_set(SAMPLE)
    texts = pset.texts
    st.success(f"{len(texts)} prompts from the bundled sample set ({SAMPLE})", icon=":material/check:")
if upload is not None:
    try:
        pset = parse_prompts(upload.getvalue(), upload.name)
        texts = pset.texts
        st.success(f"{len(texts)} prompts from {upload.name}")
        if pset.skipped:
            st.warning(f"Skipped {len(pset.skipped)} entries: " + "; ".join(pset.skipped[:10]))
    except UserError as exc:
        show_error(str(exc))

follow_view("ps", runs_from_query()[0], with_text=False)  # the form shows the model and settings on screen
spec, submitted = spec_form("ps", with_text=False, run_now=sample)  # the sample button runs at once
just_run = None
if submitted and spec is not None:
    if not texts:
        show_error("Upload a prompt file first, or press “Try the bundled sample set”.")
    else:
        just_run = run_with_status(replace(spec, texts=tuple(texts)), progress_bar=True)
        if just_run:
            mark_shown("ps", just_run)
runs = current_runs(just_run)
if runs:
    n = min(len(r.meta.sequences) for r in runs)
    new_set = into_view_once(",".join(r.run_id for r in runs), slot="set")  # a new set: its summary on screen
    st.subheader(f"The whole set: all {n:,} prompts, per dtype")
    verdict_cards(run_verdicts(runs, get_store().diagnostics_for_run(runs[0].run_id)))
    keys = list(runs[0].summary)
    agg = pd.DataFrame(
        {r.dtype: [summary_value(k, r.summary.get(k)) for k in keys] for r in runs}, index=[summary_label(k) for k in keys]
    )
    st.dataframe(agg, width="stretch")
    st.subheader(f"Per prompt, the largest gap first: click a row to open it below ({n:,} prompts)")
    # from each run's per-prompt summaries (no prompt's positions are read until it is opened)
    infos = runs[0].meta.sequences[:n]
    table = pd.DataFrame(
        {"prompt": range(1, n + 1), "text": [s.text[:120] for s in infos], "tokens": [s.summary["n_tokens"] for s in infos]}
    )
    levels = prompt_levels(tuple(r.run_id for r in runs))  # each prompt's own verdict, as it reads when opened
    for k, r in enumerate(runs):
        table[f"verdict {r.dtype}"] = [lv[k] for lv in levels]
        table[f"largest gap {r.dtype}"] = [s.summary["max_abs_delta"] for s in r.meta.sequences[:n]]
        table[f"mean gap {r.dtype}"] = [s.summary["mean_abs_delta"] for s in r.meta.sequences[:n]]
    table = table.sort_values(f"largest gap {runs[0].dtype}", ascending=False, kind="stable", na_position="last")
    # a click on any cell opens that row's prompt (cell selection), as does the row's checkbox
    picked = picked_rows(
        table,
        "ps-table",
        column_config=sci_columns(table, skip=("prompt", "tokens", *(c for c in table if c.startswith("verdict")))),
    )
    # the shown order is the largest gap first; people number prompts from 1, the stored index from 0
    picked = [int(table["prompt"].iloc[i]) - 1 for i in picked]
    # nothing picked: the prompt the link names, else the top row (the largest gap), as the table invites
    worst = int(table["prompt"].iloc[0]) - 1
    chosen = picked[0] if picked else query_int("seq", worst, 0, n - 1)
    set_query(seq=chosen)
    st.divider()
    show_runs(runs, page="prompt-set", seq_fixed=int(chosen), into_view=not new_set)
