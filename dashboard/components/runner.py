"""Run a comparison with visible progress; errors become messages and the app stays up."""

from __future__ import annotations

import streamlit as st

from core.analysis.compare import compare
from core.errors import EngineError, UserError
from core.results.run import Run
from dashboard.state import request_context, set_query


def run_with_status(spec, progress_bar: bool = False) -> list[Run] | None:
    steps = 2 + 6 * max(1, len(spec.dtypes))
    done = 0
    bar = st.progress(0.0, text="starting") if progress_bar else None
    with st.status("Comparing…", expanded=True) as status:

        def on_event(stage: str, dtype: str | None, detail: str) -> None:
            nonlocal done
            done += 6 if stage == "cache" else 1
            label = f"{stage}{f' [{dtype}]' if dtype else ''}: {detail}"
            status.write(label)
            status.update(label=label)
            if bar is not None:
                bar.progress(min(done / steps, 1.0), text=label)

        failed: Exception | None = None
        try:
            runs = compare(spec, request_context(on_event))
            status.update(label="Done", state="complete", expanded=False)
        except UserError as exc:
            status.update(label="Could not run", state="error", expanded=False)
            failed = exc
        except EngineError as exc:
            status.update(label="An engine failed", state="error", expanded=False)
            failed = exc
    # outside the collapsed status box, so the message is visible without a click
    if isinstance(failed, UserError):
        st.error(str(failed), icon=":material/error:")
        set_query(runs=None)  # the previous result must not stay below as if it were this one
        return None
    if failed is not None:
        first, _, rest = str(failed).partition("\n")
        st.error(f"{first} The next run starts a fresh engine.", icon=":material/error:")
        if rest:
            with st.expander("engine log"):
                st.code(rest)
        set_query(runs=None)
        return None
    if bar is not None:
        bar.progress(1.0, text="done")
    return runs
