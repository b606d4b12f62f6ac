"""Run a job (a comparison, a diagnosis) with progress in words; errors become visible messages.

The job runs in a worker thread while the page's script thread redraws the status once a second,
so a long step still shows what it waits for and for how long ("starting engines, 34 s"), and a
job queued behind another says its place in line. The worker never calls Streamlit: it only puts
events on a queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import streamlit as st

from logprob_parity.analysis.compare import compare
from logprob_parity.dashboard.components.alerts import bring_into_view, show_error
from logprob_parity.dashboard.components.model_field import model_words
from logprob_parity.dashboard.state import request_context, set_query
from logprob_parity.errors import EngineError, UserError
from logprob_parity.results.run import Run

T = TypeVar("T")

# What each stage means, for someone who has never seen the code.
STAGE_WORDS = {
    "resolve": "Finding the model (the embedded demo model is unpacked on first use, about 20 s)",
    "tokenize": "Splitting the text into tokens",
    "load": "Engines",
    "queue": "Waiting for another job",
    "score": "Scoring every token",
    "sample": "Sampling completions with vLLM's generation path",
    "compare": "Computing the differences",
    "store": "Saving the result",
    "cache": "Found in the store: no engine needed",
    "batch": "Scoring the prompts a batch at a time",
    "noise": "Measuring the noise floor",
    "reference": "Computing the float64 reference",
    "downstream": "Checking generated text and multiple-choice answers",
    "ablation": "Trying one setting at a time",
    "layers": "Capturing every layer on both engines",
}


def describe(stage: str, dtype: str | None, detail: str) -> str:
    words = STAGE_WORDS.get(stage, stage)
    return f"{words}{f' [{dtype}]' if dtype else ''}: {detail}"


PROGRESS = "__progress__"  # an on_progress call on the events queue


CACHED_STEPS = 6  # the steps of a comparison a dtype (load, score, floor, ...) that a stored one skips


def run_job(
    job: Callable[[Any], T],
    title: str,
    steps: int,
    progress_bar: bool = False,
    clear: str = "runs",
    dtypes: int = 1,
    *,
    model: str | None,
    estimate: tuple[str, float] | None = None,
) -> T | None:
    """Run job(ctx) with a live status that names `model` (the spec's, as typed) before anything starts
    and on every line after; on failure show the message at once (outside the collapsed box) and clear
    the query key `clear`, so an older result does not stay on screen as if it were this one.
    `estimate`: (kind, seconds) said before it started; a run over twice that says so, and the next
    estimate of the kind learns from it (analysis.estimate.judged)."""
    events: queue.Queue = queue.Queue()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = job(
                request_context(
                    lambda stage, d, detail: events.put((stage, d, detail)),
                    lambda d, n, total: events.put((PROGRESS, d, (n, total))),
                )
            )
        except BaseException as exc:
            box["error"] = exc
        finally:
            events.put(None)  # done: the page stops waiting at once, not at its next tick

    worker = threading.Thread(target=work, name="lpp-job", daemon=True)
    t0 = time.monotonic()
    done = 0
    tokens: dict[str | None, tuple[int, int]] = {}  # dtype -> (tokens scored, tokens in all), from batches
    last = "starting"
    bring_into_view("progress")  # below the form on a 1400x900 screen: Run must visibly start something
    bar = st.progress(0.0, text="starting") if progress_bar else None
    who = model_words(model)
    with st.status(f"{title} {who}…", expanded=True) as status:
        status.write(f"Model: {who}")
        worker.start()
        while True:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                event = ()
            if event is None:
                break
            if event and event[0] == PROGRESS:
                tokens[event[1]] = event[2]
            elif event:
                stage, d, detail = event
                if stage == "cache":  # work found in the store is work this run need not do: fewer steps
                    steps = max(done + 1, steps - CACHED_STEPS)  # (it read "step 14 of about 30" from the start)
                else:
                    done += 0 if stage in ("queue", "batch") else 1
                last = describe(stage, d, detail)
                status.write(last)
            elapsed = time.monotonic() - t0
            if tokens:  # a long set: the share of its tokens scored, in every dtype asked for
                n_done = sum(n for n, _ in tokens.values())
                n_all = max(tokens.values(), key=lambda x: x[1])[1] * max(1, dtypes)
                frac = n_done / n_all if n_all else 0.0
                label = f"{who} · {n_done:,} of {n_all:,} tokens scored · {last} · {elapsed:.0f} s"
            else:
                frac = done / steps
                label = f"{who} · step {min(done, steps)} of about {steps} · {last} · {elapsed:.0f} s"
            status.update(label=label)
            if bar is not None:
                bar.progress(min(frac, 1.0), text=label)
        worker.join()
        failed = box.get("error")
        if failed is None:
            status.update(label=f"{who}: done in {time.monotonic() - t0:.1f} s", state="complete", expanded=False)
        else:
            status.update(
                label=f"Could not run {who}" if isinstance(failed, UserError) else f"An engine failed ({who})",
                state="error",
                expanded=False,
            )
    if failed is None:
        if bar is not None:
            bar.progress(1.0, text="done")
        if estimate is not None:
            from logprob_parity.analysis.estimate import judged
            from logprob_parity.dashboard.state import device_here

            over = judged(estimate[0], device_here(), estimate[1], time.monotonic() - t0)
            if over:
                st.warning(over, icon=":material/schedule:")
        return box.get("result")
    set_query(**{clear: None})
    if isinstance(failed, UserError):
        show_error(str(failed))
        return None
    if isinstance(failed, EngineError):
        first, _, rest = str(failed).partition("\n")
        show_error(f"{first} The next run starts a fresh engine.")
        if rest:
            with st.expander("engine log"):
                st.code(rest)
        return None
    raise failed


def run_with_status(spec, progress_bar: bool = False) -> list[Run] | None:
    """A comparison with live progress (2 steps to prepare, then 6 per dtype)."""
    return run_job(
        lambda ctx: compare(spec, ctx),
        "Comparing",
        2 + 6 * max(1, len(spec.dtypes)),
        progress_bar,
        dtypes=len(spec.dtypes),
        model=spec.model,
    )
