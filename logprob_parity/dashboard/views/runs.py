"""Runs page: stored comparisons (one row per comparison, all its dtypes together) and diagnostics;
open any without recomputing, or delete."""

import pandas as pd
import streamlit as st

from logprob_parity.dashboard.components.deletion import delete_step, table_key
from logprob_parity.dashboard.components.tables import picked_rows
from logprob_parity.dashboard.state import get_store, load_run
from logprob_parity.present.labels import isolated, settings_words, short_text

st.title("Stored runs")
st.caption(
    "Every comparison, rollout, frontier and diagnosis run on this server is kept. Open one to see it again without recomputing."
)
store = get_store()
df = store.list_runs()
diags = store.list_diagnostics()
ros = store.list_rollouts()
frs = store.list_frontiers()
if df.empty and diags.empty and ros.empty and frs.empty:
    st.info("No stored runs yet. Run a comparison on the Compare page.", icon=":material/info:")
    st.stop()


def comparisons(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per comparison: the runs that differ only in dtype, newest first."""
    rows = []
    # a dtype run twice for the same comparison (a rerun after deleting, say) starts another row
    runs = runs.sort_values("created", ascending=False).assign(nth=lambda d: d.groupby(["comparison", "dtype"]).cumcount())
    for _, g in runs.groupby(["comparison", "nth"], sort=False):
        g = g.sort_values("dtype")
        rows.append(
            {
                "text": g["first_text"].iloc[0]
                # two sets that differ in one line read alike by their first prompt: the key of their
                # texts and settings tells them apart
                + (
                    f"  (+{int(g['n_sequences'].iloc[0]) - 1} more prompts; set {g['comparison'].iloc[0][:6]})"
                    if g["n_sequences"].iloc[0] > 1
                    else ""
                ),
                "model": g["model"].iloc[0],
                "dtypes": ", ".join(g["dtype"]),
                "settings": settings_words(g["settings"].iloc[0]),
                "largest gap": " · ".join(f"{d}: {v:.2e}" for d, v in zip(g["dtype"], g["max_abs_delta"]) if v is not None),
                "tokens": int(g["n_tokens"].iloc[0]),
                "created": g["created"].max(),
                "run ids": ",".join(g["run_id"]),
                "prompts": int(g["n_sequences"].iloc[0]),
            }
        )
    return pd.DataFrame(rows).sort_values("created", ascending=False, ignore_index=True)


if not df.empty:
    table = comparisons(df)
    st.subheader("Comparisons")
    st.caption(f"{len(table)} comparisons ({len(df)} runs, one per dtype) in {store.root}. Tick rows to open or delete them.")
    picked = picked_rows(
        table,
        table_key("runs-table"),
        many=True,
        column_config={
            "text": st.column_config.TextColumn("text", width="large"),
            "run ids": st.column_config.TextColumn("run ids", width="small"),
            "prompts": None,
        },
    )
    selected = [rid for i in picked for rid in table.loc[i, "run ids"].split(",")][:8]
    c1, c2, c3 = st.columns(3)
    if c3.button(
        "Diff the two selected runs",
        disabled=len(selected) != 2,
        icon=":material/difference:",
        key="runs-diff",
        help="Tick one comparison with two dtypes, or two comparisons of the same texts: what changed, token by token",
    ):
        # A is the reference: the more precise dtype, else the older run; B what changed
        rank = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}
        meta = df.set_index("run_id")
        pair = sorted(selected, key=lambda r: (rank.get(meta.loc[r, "dtype"], 9), meta.loc[r, "created"]))
        st.switch_page("views/diff.py", query_params={"diff": ",".join(pair)})
    if c1.button("Open selected", disabled=not selected, type="primary", icon=":material/open_in_new:"):
        # a comparison of several prompts opens where all of them show (its form reruns them all)
        several = any(table.loc[i, "prompts"] > 1 for i in picked)
        st.switch_page(
            "views/prompt_set.py" if several else "views/compare.py", query_params={"runs": ",".join(selected), "seq": "0"}
        )
    # each run by id, text, dtype and settings: rows that read alike on screen are told apart
    by_id = df.set_index("run_id")
    what = f"{len(selected)} run{'s' if len(selected) != 1 else ''}: " + "; ".join(
        f"{rid[:12]} (“{isolated(short_text(by_id.loc[rid, 'first_text']))}”, {by_id.loc[rid, 'dtype']}, "
        f"settings: {settings_words(by_id.loc[rid, 'settings'])})"
        for rid in selected
    )

    def delete_run(rid: str) -> None:
        store.delete(rid)
        load_run.clear()

    delete_step("runs-table", selected, what, delete_run, "Delete selected", c2)

if not ros.empty:
    st.subheader("Rollouts")
    st.caption("vLLM's generation path against the trainer's scoring: the gap shown is vLLM decode against HF.")
    shown_ro = ros.rename(
        columns={
            "first_text": "prompt",
            "n_samples": "samples",
            "max_abs_delta": "largest gap",
            "mean_abs_delta": "mean gap",
            "rollout_id": "id",
            "level": "verdict",
        }
    )[
        [
            "prompt",
            "model",
            "dtype",
            "sampling",
            "samples",
            "tokens" if "tokens" in ros else "n_tokens",
            "largest gap",
            "mean gap",
            "verdict",
            "created",
            "id",
        ]
    ]
    picked_ro = picked_rows(
        shown_ro,
        table_key("rollout-table"),
        many=True,
        column_config={
            "prompt": st.column_config.TextColumn("prompt", width="large"),
            "largest gap": st.column_config.NumberColumn(format="%.2e"),
            "mean gap": st.column_config.NumberColumn(format="%.2e"),
        },
    )
    ids = [shown_ro.iloc[i]["id"] for i in picked_ro][:4]
    r1, r2 = st.columns(2)
    if r1.button("Open rollouts", disabled=not ids, type="primary", icon=":material/model_training:", key="rollout-open"):
        st.switch_page("views/rollout.py", query_params={"rollout": ",".join(ids), "sample": "0"})
    delete_step(
        "rollout-table", ids, f"{len(ids)} rollout{'s' if len(ids) != 1 else ''}", store.delete_rollout, "Delete rollouts", r2
    )

if not frs.empty:
    st.subheader("Frontiers")
    frs["recommendation"] = frs["recommendation"].fillna("none within the tolerance")  # words, never "None"
    shown_fr = frs.rename(columns={"first_text": "text", "n_configs": "configurations", "frontier_id": "id"})[
        ["text", "model", "configurations", "recommendation", "created", "id"]
    ]
    rows_fr = picked_rows(shown_fr, "frontier-table", column_config={"text": st.column_config.TextColumn("text", width="large")})
    if st.button("Open frontier", disabled=not rows_fr, icon=":material/speed:", key="frontier-open"):
        st.switch_page("views/frontier.py", query_params={"frontier": shown_fr.iloc[rows_fr[0]]["id"]})

if not diags.empty:
    st.subheader("Diagnostics")
    shown = diags[["first_text", "model", "dtypes", "parts", "created", "diagnostics_id"]].rename(
        columns={"first_text": "text", "parts": "checks", "diagnostics_id": "id"}
    )
    rows = picked_rows(shown, "diag-table", column_config={"text": st.column_config.TextColumn("text", width="large")})
    if st.button("Open diagnostics", disabled=not rows, icon=":material/stethoscope:", key="diag-open"):
        st.switch_page("views/diagnostics.py", query_params={"diag": shown.iloc[rows[0]]["id"]})
