"""Prompt sets and logged rollouts on a Ray cluster: the same run as one process, whatever happens.

Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`) runs real raylets on this machine,
one a node: a head and two more, each with one CPU, so each node takes one worker. The plumbing
tests run the fake engines (real engine-host processes and sockets, no model); one test runs the
real HF and vLLM engines on the demo model and checks every value bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import cli_env, kill_after_parts

ray = pytest.importorskip("ray", reason="Ray is the optional extra .[ray]; scripts/setup.sh --test installs it")

TEXTS = tuple(f"Prompt {i}: the quick brown fox jumps over the lazy dog {i % 13} times." for i in range(2000))


@pytest.fixture(scope="module")
def cluster():
    """A head node and two worker nodes of one CPU each (Ray's own test cluster, real processes)."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


@pytest.fixture()
def fake(monkeypatch):
    """Fake engine hosts here and on the workers (the driver passes LPP_* variables to its workers)."""
    monkeypatch.setenv("LPP_FAKE_ENGINES", "1")
    from logprob_parity.engines.pool import EnginePool

    pool = EnginePool()
    yield pool
    pool.shutdown(grace=2.0)


def _ctx(home, **kw):
    from logprob_parity.analysis.request import Context
    from logprob_parity.results.store import Store

    return Context.of(store=Store(home), **kw)


def _assert_same_run(a, b):
    """Same run id, summary, token ids and every per-position value, bit for bit."""
    assert a.run_id == b.run_id
    assert a.summary == b.summary
    fa, fb = a.to_frame(), b.to_frame()
    assert list(fa.columns) == list(fb.columns) and len(fa) == len(fb)
    for col in fa.columns:
        if fa[col].dtype == object:
            assert _cells(fa[col]) == _cells(fb[col]), col
        else:
            np.testing.assert_array_equal(fa[col].to_numpy(), fb[col].to_numpy(), err_msg=col)


def _cells(column) -> list:
    """An object column's cells, comparable with == bit for bit: an array (a row's top-k) as its dtype,
    shape and bytes (its values where it holds text); anything else (text, None) as it is. numpy's repr,
    used before, rounds to 8 digits and took 30 s for the 48,000 rows of 2,000 prompts."""
    return [
        (c.dtype.str, c.shape, c.tolist() if c.dtype == object else c.tobytes()) if isinstance(c, np.ndarray) else c
        for c in column.tolist()
    ]


def test_a_2000_prompt_set_on_three_ray_nodes_is_the_single_process_run(cluster, fake, tiny_bos, tmp_path, monkeypatch):
    """Fake engines: 2,000 prompts in batches on three workers give the run id, summary and values of
    one process; the progress says done/total, tokens/s, time left and workers alive, in words and numbers."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec

    monkeypatch.setenv("LPP_BATCH_TOKENS", "4000")
    spec = RunSpec(texts=TEXTS, model=str(tiny_bos), dtypes=("float32",), device="cpu")
    (one,) = compare(spec, _ctx(tmp_path / "one", pool=fake), use_cache=False)
    words, numbers = [], []
    ctx = _ctx(
        tmp_path / "ray",
        pool=fake,
        ray=cluster.address,
        on_event=lambda stage, d, detail: words.append((stage, detail)),
        on_status=lambda d, n: numbers.append(n),
    )
    (many,) = compare(spec, ctx, use_cache=False)
    assert one.meta.timing["batches"] == many.meta.timing["batches"] >= 8
    assert many.meta.timing["ray_workers"] == 3
    _assert_same_run(one, many)
    batches = [d for s, d in words if s == "batch"]
    assert len(batches) == many.meta.timing["batches"], words
    assert all("tokens/s" in d and "of 3 Ray workers alive" in d for d in batches), batches
    assert "left" in batches[0]
    assert numbers[-1]["done"] == numbers[-1]["total"] == sum(len(s.token_ids) - 1 for s in many.sequences)
    assert {"per_s", "seconds_left", "workers_alive", "workers"} <= set(numbers[0])
    assert not (tmp_path / "ray" / "partial" / many.run_id).exists()


def test_a_node_removed_mid_run_loses_no_prompt_and_counts_none_twice(cluster, fake, tiny_bos, tmp_path, monkeypatch):
    """A fourth node is removed after the first part comes back: its worker's batch goes to the
    others, the run completes with every prompt exactly once, and it is the single-process run."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec

    monkeypatch.setenv("LPP_BATCH_TOKENS", "300")
    monkeypatch.setenv("LPP_FAKE_SCORE_S", "0.5")  # each batch takes a while: the node dies holding one
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    spec = RunSpec(texts=TEXTS[:240], model=str(tiny_bos), dtypes=("float32",), device="cpu")
    words: list[tuple[str, str]] = []
    removed = threading.Event()

    def on_event(stage, dtype, detail):
        words.append((stage, detail))
        if stage == "batch" and not removed.is_set():
            removed.set()
            cluster.remove_node(node)

    ctx = _ctx(tmp_path / "ray", pool=fake, ray=cluster.address, on_event=on_event)
    (run,) = compare(spec, ctx, use_cache=False)
    lost = [d for s, d in words if s == "worker"]
    assert removed.is_set() and len(lost) == 1 and "goes to another worker" in lost[0], words
    assert run.meta.timing["ray_workers"] == 4 and run.meta.timing["ray_workers_alive"] == 3
    assert [s.text for s in run.sequences] == list(spec.texts)  # each prompt once, in order
    assert len([s for s, _ in words if s == "batch"]) == run.meta.timing["batches"]  # each batch counted once
    monkeypatch.setenv("LPP_FAKE_SCORE_S", "0")
    (one,) = compare(spec, _ctx(tmp_path / "one", pool=fake), use_cache=False)
    _assert_same_run(one, run)


def test_a_killed_ray_driver_run_again_computes_only_the_missing_batches(cluster, fake, tiny_bos, home, tmp_path, monkeypatch):
    """`compare --prompts --ray ADDRESS` killed with SIGKILL after some parts were stored: the same
    command says how many came from the store and gives the single-process run; --events logs the
    cluster's progress as JSON lines."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    prompts = tmp_path / "set.txt"
    prompts.write_text("\n".join(TEXTS[:300]) + "\n")
    env = dict(cli_env(home), LPP_BATCH_TOKENS="400", LPP_FAKE_ENGINES="1", LPP_FAKE_SCORE_S="0.4")
    cmd = [sys.executable, "-m", "logprob_parity.cli", "compare", "--model", str(tiny_bos), "--prompts", str(prompts)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--ray", cluster.address]
    stored = kill_after_parts(cmd, env, home, 3)
    events = tmp_path / "events.jsonl"
    again = subprocess.run(
        cmd + ["--json", str(tmp_path / "out.json"), "--events", str(events)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{stored} of " in again.stderr and "batches came from the store" in again.stderr, again.stderr[-3000:]
    ticks = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "progress"]
    assert ticks and ticks[-1]["done"] == ticks[-1]["total"] and ticks[-1]["workers_alive"] == 3, ticks[-1:]
    run = Store(home).load(json.loads((tmp_path / "out.json").read_text())["run_id"])
    assert run.meta.timing["batches_from_store"] == stored
    monkeypatch.setenv("LPP_BATCH_TOKENS", "400")
    spec = RunSpec(texts=TEXTS[:300], model=str(tiny_bos), dtypes=("float32",), device="cpu")
    (one,) = compare(spec, _ctx(tmp_path / "one", pool=fake), use_cache=False)
    _assert_same_run(one, run)


def test_a_rescore_on_ray_workers_is_the_single_process_rescore(cluster, fake, tiny_bos, tmp_path, monkeypatch):
    """Logged rollouts rescored on three workers: the same rollout id, summary and every value."""
    from logprob_parity.analysis.rescore import rescore
    from logprob_parity.inputs.spec import RunSpec

    rng = np.random.default_rng(0)
    lines = [
        json.dumps(
            {
                "prompt_token_ids": [0, *rng.integers(40, 500, 6).tolist()],
                "completion_token_ids": rng.integers(40, 500, 10).tolist(),
                "logprobs": (-rng.random(10) * 3).tolist(),
            }
        )
        for _ in range(90)
    ]
    path = tmp_path / "logged.jsonl"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("LPP_BATCH_TOKENS", "80")
    spec = RunSpec(texts=("logged",), model=str(tiny_bos), dtypes=("float32",), device="cpu")
    (one,) = rescore(path, path.name, spec, _ctx(tmp_path / "one", pool=fake), use_cache=False)
    (many,) = rescore(path, path.name, spec, _ctx(tmp_path / "ray", pool=fake, ray=cluster.address), use_cache=False)
    assert many.meta.rollout_id == one.meta.rollout_id and many.meta.summary == one.meta.summary
    assert many.meta.timing["ray_workers"] == 3 and many.meta.timing["batches"] == one.meta.timing["batches"] > 3
    assert many.meta.floors == one.meta.floors
    for x, y in zip(one.samples, many.samples):
        assert x.completion_token_ids == y.completion_token_ids and x.pieces == y.pieces
        for k in x.logprob:
            np.testing.assert_array_equal(x.logprob[k], y.logprob[k], err_msg=k)


def test_an_address_that_does_not_answer_fails_in_words_before_any_work(tiny_bos, home, capsys):
    from logprob_parity.cli import main

    rc = main(["compare", "--model", str(tiny_bos), "--prompt", "hello", "--device", "cpu", "--quiet", "--ray", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "no Ray cluster answers at 127.0.0.1:9" in err and "ray start --head" in err, err
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())
    assert main(["compare", "--prompt", "x", "--ray-workers", "2"]) == 2
    assert "--ray-workers needs --ray" in capsys.readouterr().err


def test_without_ray_installed_the_ray_flag_says_how_to_install_it(tiny_bos, home, capsys, monkeypatch):
    from logprob_parity.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed: `import ray` fails
    rc = main(["compare", "--model", str(tiny_bos), "--prompt", "hello", "--device", "cpu", "--quiet", "--ray"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'logprob-parity[ray]'" in err, err


def test_a_gpu_run_on_a_cluster_without_a_gpu_is_refused_in_words_before_any_worker_starts(cluster, tiny_bos, tmp_path):
    """The engines need a GPU (the driver's device is cuda) and the cluster's nodes offer only CPUs."""
    from logprob_parity.analysis.cluster import RayOptions, open_cluster
    from logprob_parity.analysis.request import Prepared
    from logprob_parity.errors import UserError
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.spec import RunSpec

    spec = RunSpec(texts=("hello",), model=str(tiny_bos), dtypes=("float32",), device="cuda")
    p = Prepared(spec, _ctx(tmp_path), resolve_model(str(tiny_bos), None, False, None), "cuda")
    with pytest.raises(UserError) as err, open_cluster(RayOptions(address=cluster.address), p):
        pass
    assert "no GPU" in str(err.value) and "3 CPU(s)" in str(err.value) and "--device cpu" in str(err.value)
    assert not ray.is_initialized()  # the driver let go of the cluster


@pytest.mark.engine
def test_60_prompts_on_two_ray_workers_with_real_engines_forked_from_the_zygote_match_one_process_bit_for_bit(
    cluster, tiny_bos, tmp_path, monkeypatch
):
    """The tiny Llama on the real HF and vLLM CPU engines: two workers, each with its own engines,
    score 60 prompts in batches; the run id, summary and every value are those of one process (the
    demo model proved the same in 125 s of a CI run, most of them its floors and HF's scoring on one
    core: what is checked is the path each value takes, not the model's size). In the
    test session the workers' hosts are forked from its zygote: what Ray's raylet writes into a worker's
    environment (RAY_JOB_ID, SPT_NOENV, ...) is read by Ray's own code, not by an engine's imports."""
    import os

    from conftest import start_rows

    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines.zygote import ZYGOTE_ENV
    from logprob_parity.inputs.spec import RunSpec

    monkeypatch.setenv("LPP_BATCH_TOKENS", "300")
    spec = RunSpec(texts=TEXTS[:60], model=str(tiny_bos), dtypes=("float32",), device="cpu")
    (one,) = compare(spec, _ctx(tmp_path / "one"), use_cache=False)
    logged = len(start_rows())
    (many,) = compare(spec, _ctx(tmp_path / "ray", ray={"address": cluster.address, "workers": 2}), use_cache=False)
    assert many.meta.timing["ray_workers"] == 2 and many.meta.timing["batches"] >= 4
    if os.environ.get(ZYGOTE_ENV):  # LPP_TEST_ZYGOTE=0 starts every host the ordinary way
        rows = start_rows()[logged:]
        workers = [r for r in rows if r["pid"] != os.getpid()]
        assert len(workers) >= 4, rows  # HF and vLLM on each of the two workers
        assert all(r.get("forked") for r in workers), [r.get("fork_refused") for r in workers]
    assert "exact" in many.meta.env.vllm_engine["kl_full"]
    _assert_same_run(one, many)


@pytest.mark.engine
def test_a_rollout_on_two_ray_workers_samples_the_batches_one_process_samples_bit_for_bit(
    cluster, tiny_bos, tmp_path, monkeypatch
):
    """Real engines on the tiny Llama: 8 prompts x 2 samples in batches, each batch sampled and
    rescored by a worker; the rollout id, summary, floors and every sample's tokens and values are
    those of one process sampling the same batches."""
    from logprob_parity.analysis.rollout import rollout
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.rollout import Sampling

    monkeypatch.setenv("LPP_BATCH_TOKENS", "100")
    spec = RunSpec(texts=TEXTS[:8], model=str(tiny_bos), dtypes=("float32",), device="cpu")
    sampling = Sampling(samples=2, max_tokens=12, seed=3)
    (one,) = rollout(spec, sampling, _ctx(tmp_path / "one"), use_cache=False)
    words = []
    ctx = _ctx(tmp_path / "ray", ray={"address": cluster.address, "workers": 2}, on_event=lambda s, d, x: words.append((s, x)))
    (many,) = rollout(spec, sampling, ctx, use_cache=False)
    assert many.meta.timing["ray_workers"] == 2 and many.meta.timing["batches"] == one.meta.timing["batches"] >= 3
    assert sum(s == "batch" for s, _ in words) == many.meta.timing["batches"], words
    assert many.meta.rollout_id == one.meta.rollout_id and many.meta.summary == one.meta.summary
    assert many.meta.floors == one.meta.floors and many.meta.samples == one.meta.samples
    assert len(many.samples) == 16
    for x, y in zip(one.samples, many.samples):
        assert (x.prompt_index, x.seed, x.completion_token_ids, x.pieces) == (
            y.prompt_index,
            y.seed,
            y.completion_token_ids,
            y.pieces,
        )
        for k in x.logprob:
            np.testing.assert_array_equal(x.logprob[k], y.logprob[k], err_msg=k)
