"""The `logprob-parity` command end to end, as a user runs it (subprocesses, real engines)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_env, run_files

SENTENCES = Path(__file__).resolve().parent.parent / "logprob_parity" / "data" / "sentences.txt"


def cli(home, *args, timeout=1200):
    return subprocess.run(
        [sys.executable, "-m", "logprob_parity.cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(home),
        timeout=timeout,
        check=False,
    )


@pytest.mark.engine
def test_demo_model_float32_and_bfloat16(home, demo_model, tmp_path):
    out = tmp_path / "runs.json"
    p = cli(home, "compare", "--prompts", str(SENTENCES), "--dtype", "float32,bfloat16", "--json", str(out), "--quiet")
    assert p.returncode == 0, p.stderr[-3000:]
    print(p.stdout)  # the summary table, kept in the test log
    runs = {r["dtype"]: r for r in json.loads(out.read_text())}
    f32, bf16 = runs["float32"]["summary"], runs["bfloat16"]["summary"]
    assert f32["n_tokens"] == bf16["n_tokens"] > 150
    assert f32["max_abs_delta"] <= 1e-4, f32
    assert bf16["max_abs_delta"] > 1e-3, bf16
    for r in runs.values():
        assert r["env"]["vllm"] and r["env"]["torch"] and r["env"]["transformers"] and r["env"]["device"]
        assert len(r["sequences"]) == 10
        for seq in r["sequences"]:
            assert seq["token_ids"][0] == 1  # SmolLM2's BOS, prepended by the auto policy
            assert len(seq["positions"]) == len(seq["token_ids"]) == len(seq["tokens"])

    # the same command again: from the store, no engine (its speed: benchmarks/cached_compare.py)
    again = cli(home, "compare", "--prompts", str(SENTENCES), "--dtype", "float32,bfloat16", "--quiet")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("from the store (no engine started)") == 2
    assert "starting engine" not in again.stderr and "tokenize" not in again.stderr

    rid = runs["float32"]["run_id"]
    listed = cli(home, "runs")
    assert rid in listed.stdout and "bfloat16" in listed.stdout
    shown = cli(home, "show", rid[:8], "--json")
    assert json.loads(shown.stdout)["summary"] == f32
    # every position carries its band and the run its verdict, the same in `show` as in --json (issue 40)
    assert all(p["band"] in (None, "noise", "tolerance", "beyond") for s in runs["float32"]["sequences"] for p in s["positions"])
    assert f32["tokens_beyond_frac"] is not None and runs["float32"]["verdict"]["level"]
    text = cli(home, "show", rid[:8])
    assert runs["float32"]["verdict"]["headline"] in text.stdout and " band" in text.stdout, text.stdout
    report = tmp_path / "r.json"
    assert cli(home, "report", rid, "-o", str(report)).returncode == 0
    assert json.loads(report.read_text())["run_id"] == rid


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["compare", "--model", "no-such-org/no-such-model", "--prompt", "hi there"],
            "unknown model 'no-such-org/no-such-model'",
        ),
        (["compare", "--model", "/nonexistent/folder", "--prompt", "hi there"], "does not exist"),
        (["compare", "--prompt", ""], "the prompt is empty"),
        (["compare", "--prompt", "   "], "the prompt is empty"),
        (["compare", "--prompts", "EMPTY_FILE"], "holds no prompts"),
        (["compare", "--prompt", "hi", "--dtype", "float8"], "unknown dtype 'float8'"),
        (["compare", "--prompt", "hi", "--top-k", "101"], "above the maximum of 100"),
        (["compare", "--prompt", "hi", "--top-k", "0"], "positive integer"),
        (["compare"], "exactly one of --prompt TEXT or --prompts FILE"),
        (["compare", "--prompt", "hi", "--backends", "hf"], "needs both"),
        (["show", "deadbeef"], "no stored run"),
        (["report", "deadbeef", "-o", "x.pdf"], "no stored run"),
    ],
)
def test_bad_input_exits_with_one_line(home, tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY_FILE" else a for a in args]
    p = cli(home, *args, timeout=300)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], p.stderr
    assert run_files(home) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["check", "deadbeef", "--max-abs-delta", "-1"], "--max-abs-delta: -1 is out of range: it must be at least 0"),
        (["check", "deadbeef", "--min-argmax-agreement", "1.5"], "at most 1"),
        (["frontier", "--prompt", "hi", "--tolerance", "-1"], "--tolerance: -1 is out of range: it must be more than 0"),
        (["frontier", "--prompt", "hi", "--repeats", "1"], "--repeats: 1 is out of range: it must be at least 3"),
        (["rollout", "--prompt", "hi", "--top-p", "0"], "more than 0 and at most 1"),
        (["rollout", "--prompt", "hi", "--top-k", "0"], "at least 1 (or -1)"),
        (["rollout", "--prompt", "hi", "--samples", "0"], "--samples: 0 is out of range"),
        (["rollout", "--prompt", "hi", "--temperature", "nan"], "not a finite number"),
        (["compare", "--prompt", "hi", "--gpu-memory-utilization", "1.5"], "at most 1"),
        (["compare", "--prompt", "hi", "--max-num-seqs", "x"], "'x' is not a whole number"),
        (["dashboard", "--port", "70000"], "at most 65535"),
    ],
)
def test_a_number_out_of_range_is_bad_input_refused_before_any_engine_starts(home, args, message):
    """Item 8 of the first hour: `check --max-abs-delta -1` was a parity failure (exit 1) and
    `frontier --tolerance -1` ran 260 s before it said no configuration was within -1."""
    t = time.perf_counter()
    p = cli(home, *args, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    last = [line for line in p.stderr.splitlines() if line.strip()][-1]
    assert "error: argument" in last and message in last, p.stderr
    assert time.perf_counter() - t < 60 and run_files(home) == []  # refused by the parser, not after a run


@pytest.mark.parametrize("command", ["compare --prompts", "rescore --rollouts"])
def test_a_folder_given_for_a_file_is_named_a_folder(home, tmp_path, command):
    p = cli(home, *command.split(), str(tmp_path), timeout=120)
    assert p.returncode == 2 and "is a folder" in p.stderr.splitlines()[-1], p.stderr


@pytest.mark.engine
def test_too_long_and_no_tokenizer(home, tiny_bos, tmp_path):
    """Checks that need the model's config and tokenizer, still before any engine starts."""
    long_text = " ".join(["lawyer guitar hiking family"] * 80)
    p = cli(home, "compare", "--model", str(tiny_bos), "--prompt", long_text, timeout=300)
    assert p.returncode == 2 and "has 128 positions" in p.stderr.splitlines()[-1], p.stderr
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text((Path(tiny_bos) / "config.json").read_text())
    p = cli(home, "compare", "--model", str(folder), "--prompt", "hello world", timeout=300)
    assert p.returncode == 2 and "tokenizer" in p.stderr.splitlines()[-1], p.stderr
    assert run_files(home) == []


def test_store_folder_not_writable(home, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    env_home = blocker / "store"
    p = subprocess.run(
        [sys.executable, "-m", "logprob_parity.cli", "runs"],
        capture_output=True,
        text=True,
        env=cli_env(env_home),
        timeout=120,
        check=False,
    )
    assert p.returncode == 2 and "not usable" in p.stderr and "LOGPROB_PARITY_HOME" in p.stderr


def test_no_gpu_for_device_cuda(home):
    from logprob_parity.env import cuda_present

    if cuda_present():
        pytest.skip("this machine has a GPU")
    p = cli(home, "compare", "--prompt", "hello there", "--device", "cuda", timeout=120)
    assert p.returncode == 2 and "no NVIDIA GPU is visible" in p.stderr.splitlines()[-1]
    assert run_files(home) == []
