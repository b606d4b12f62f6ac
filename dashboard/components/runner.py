"""Run a comparison with visible progress; errors become messages and the app stays up."""

from __future__ import annotations

import streamlit as st

from core.compare import compare
from core.errors import EngineError, UserError
from core.run import Run
from dashboard.state import get_store, model_roots


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

        try:
            runs = compare(spec, store=get_store(), on_event=on_event, model_roots=model_roots())
        except UserError as exc:
            status.update(label="Could not run", state="error", expanded=False)
            st.error(str(exc))
            return None
        except EngineError as exc:
            status.update(label="An engine failed", state="error", expanded=False)
            first, _, rest = str(exc).partition("\n")
            st.error(f"{first} The next run starts a fresh engine.")
            if rest:
                with st.expander("engine log"):
                    st.code(rest)
            return None
        status.update(label="Done", state="complete", expanded=False)
    if bar is not None:
        bar.progress(1.0, text="done")
    return runs
