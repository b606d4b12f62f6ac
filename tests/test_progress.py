"""Long work says what it waits for: a tqdm bar in the CLI for every long command where a person
watches a terminal (event lines alone when piped), and the Python API printing its steps by default
when run interactively."""

from __future__ import annotations

import argparse
import io
import sys

import pytest

from logprob_parity.cli import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_long_command_shows_a_bar_on_a_terminal_and_only_its_event_lines_when_piped(monkeypatch, tty):
    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with progress(argparse.Namespace(quiet=False), "rollout", steps=4) as (on_event, _, _):
        on_event("load", "float32", "vllm (float32) engine starting")
        on_event("sample", "float32", "2 samples")
    out = err.getvalue()
    assert "load [float32]: vllm (float32) engine starting" in out and "sample [float32]: 2 samples" in out
    assert ("2/4" in out and "step" in out) == tty  # the bar counts steps, drawn on a terminal only


def test_the_bar_counts_tokens_once_the_work_reports_them(monkeypatch):
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with progress(argparse.Namespace(quiet=False), "rescore", steps=7, n_dtypes=2) as (on_event, on_progress, _):
        on_event("load", None, "engines")
        on_progress("float32", 500, 1000)
        on_progress("bfloat16", 250, 1000)
    out = err.getvalue()
    assert "750/2.00k" in out and "tok" in out, out[-300:]


def test_quiet_silences_both(monkeypatch):
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with progress(argparse.Namespace(quiet=True), "frontier", steps=3) as (on_event, _, _):
        on_event("load", None, "engines")
    assert err.getvalue() == ""


def test_the_python_api_prints_its_steps_by_default_when_a_person_is_watching(monkeypatch):
    import logprob_parity as lp

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # piped, no prompt, no notebook: quiet
    monkeypatch.delattr(sys, "ps1", raising=False)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert lp._interactive() is False
    lp._ctx(None, None).on_event("load", "float32", "engines starting")
    assert out.getvalue() == ""
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # Python's interactive prompt
    assert lp._interactive() is True
    lp._ctx(None, None).on_event("load", "float32", "engines starting")
    assert out.getvalue() == "load [float32]: engines starting\n"
    lp._ctx(None, False).on_event("score", None, "quiet")  # asked for silence, silent
    assert "quiet" not in out.getvalue()
