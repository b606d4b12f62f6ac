"""Prompt sets in batches: the same run whatever the batch size, and a killed run that resumes.

Real engines on the tiny Llama (HF and vLLM on the CPU): each batch is scored, compared and stored
as it finishes, so memory is bounded by a batch and a run killed with `kill -9` computes only the
batches it lacks when the same command runs again."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import cli_env, kill_after_parts

from logprob_parity.analysis.compare import plan_batches

LINES = [f"Prompt number {i}: the quick brown fox jumps over the lazy dog {i % 7} times." for i in range(24)]


def test_batches_are_consecutive_bounded_and_never_empty():
    """Batches cover every sequence once, in order, hold at most the token cap (a longer sequence
    gets a batch of its own), and the exact KL's row bytes cap them too."""
    lengths = [10, 10, 10, 50, 3, 3, 3]
    os.environ["LPP_BATCH_TOKENS"] = "20"
    try:
        plan = plan_batches(lengths, None, "cpu")
        assert plan == [(0, 2), (2, 3), (3, 4), (4, 7)]
        assert plan_batches(lengths, 512, "cpu") == plan
        from logprob_parity.engines import fullvocab

        old = fullvocab.MAX_BYTES
        fullvocab.MAX_BYTES = 4 * 512 * 9  # nine rows of a 512-entry vocabulary
        try:
            assert plan_batches(lengths, 512, "cpu") == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 7)]
        finally:
            fullvocab.MAX_BYTES = old
    finally:
        del os.environ["LPP_BATCH_TOKENS"]


@pytest.mark.engine
def test_a_set_in_batches_is_the_same_run_as_in_one(tiny_bos, home, monkeypatch):
    """Six batches or one: the same run id, token ids, values, exact KL and summary."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    spec = RunSpec(texts=tuple(LINES), model=str(tiny_bos), dtypes=("float32",), device="cpu")
    (one,) = compare(spec, store=Store(home / "one"), use_cache=False)
    monkeypatch.setenv("LPP_BATCH_TOKENS", "100")
    (many,) = compare(spec, store=Store(home / "many"), use_cache=False)
    assert one.meta.timing["batches"] == 1 and many.meta.timing["batches"] >= 4
    assert one.run_id == many.run_id
    assert one.summary == many.summary
    for a, b in zip(one.sequences, many.sequences):
        assert a.token_ids == b.token_ids and a.pieces == b.pieces
        for side in ("hf", "vllm"):
            np.testing.assert_array_equal(getattr(a, side).logprob, getattr(b, side).logprob)
            np.testing.assert_array_equal(getattr(a, side).topk_ids, getattr(b, side).topk_ids)
        np.testing.assert_array_equal(a.metrics.kl_full, b.metrics.kl_full)
    assert not (home / "many" / "partial" / many.run_id).exists()  # finished: no parts left behind


@pytest.mark.engine
def test_a_killed_run_resumes_without_recomputing_its_stored_batches(tiny_bos, home, tmp_path):
    """`compare --prompts` killed with SIGKILL after some batches were stored: the same command run
    again says how many batches came from the store, computes the rest, and gives the run an
    uninterrupted one gives."""
    prompts = tmp_path / "set.txt"
    prompts.write_text("\n".join(LINES * 4) + "\n")
    env = dict(cli_env(home), LPP_BATCH_TOKENS="60")
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.cli",
        "compare",
        "--model",
        str(tiny_bos),
        "--prompts",
        str(prompts),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    stored = kill_after_parts(cmd, env, home, 3)
    again = subprocess.run(
        cmd + ["--json", str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{stored} of " in again.stderr and "batches came from the store" in again.stderr, again.stderr[-3000:]
    import json

    data = json.loads((tmp_path / "out.json").read_text())
    assert len(data["sequences"]) == len(LINES) * 4
    from logprob_parity.results.store import Store

    run = Store(home).load(data["run_id"])
    assert run.meta.timing["batches_from_store"] == stored
    clean = subprocess.run(
        cmd + ["--no-cache", "--json", str(tmp_path / "clean.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert clean.returncode == 0, clean.stderr[-3000:]
    fresh = json.loads((tmp_path / "clean.json").read_text())
    assert fresh["run_id"] == data["run_id"] and fresh["summary"] == data["summary"]
    assert [s["positions"] for s in fresh["sequences"]] == [s["positions"] for s in data["sequences"]]
