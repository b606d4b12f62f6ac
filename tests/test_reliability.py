"""Crashed engines, concurrent clients, and the bad inputs that need a model or an engine."""

import os
import signal
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import run_files

from logprob_parity.analysis.compare import compare
from logprob_parity.engines import pool
from logprob_parity.errors import EngineError, UserError
from logprob_parity.inputs.spec import EngineSettings, RunSpec
from logprob_parity.results.store import Store

engine = pytest.mark.engine


def _spec(model, text="Shall I compare thee to a summer's day?", seed=0, **kw):
    return RunSpec(texts=(text,), model=str(model), dtypes=("float32",), top_k=3, settings=EngineSettings(seed=seed, **kw))


def _workers(backend, engines=pool.POOL):
    return [w for w in engines.running() if w.label.startswith(backend)]


def _wait_for_worker(backend, exclude, timeout=120, engines=pool.POOL):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in _workers(backend, engines):
            if w.pid not in exclude:
                return w
        time.sleep(0.1)
    raise AssertionError(f"no new {backend} worker appeared")


@engine
@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_kill_9_a_worker_mid_run(home, tiny_nobos, backend, cold_start):
    """The run fails with a clear message, nothing is stored, and the next run starts fresh and succeeds."""
    from logprob_parity.analysis.request import Context

    store = Store(home)
    # a pool of its own and settings no other test uses: cold workers for both engines (no spare that
    # did its imports), so the kill lands mid-start
    cold = pool.EnginePool()
    ctx = Context.of(store=store, pool=cold)
    spec = _spec(tiny_nobos, seed=1000 + len(backend), attn_implementation="eager" if backend == "hf" else None)
    errors = []
    try:
        t = threading.Thread(target=lambda: _run_catching(errors, spec, ctx))
        t.start()
        victim = _wait_for_worker(backend, set(), engines=cold)
        time.sleep(2.0)
        os.kill(victim.pid, signal.SIGKILL)
        t.join(600)
        assert len(errors) == 1 and isinstance(errors[0], EngineError), errors
        assert "died" in str(errors[0]) and "signal 9" in str(errors[0])
        assert store.list_runs().empty and run_files(home) == []
        (run,) = compare(spec, ctx)
        assert run.summary["n_tokens"] > 5 and store.has(run.run_id)
        assert victim.pid not in {w.pid for w in cold.running()}
    finally:
        cold.shutdown(grace=2.0)


@engine
def test_a_warm_worker_that_died_is_replaced(home, tiny_bos):
    store = Store(home)
    compare(_spec(tiny_bos), store=store)
    hf = max(_workers("hf (float32)"), key=lambda w: w.last_used)  # the one that just scored
    os.kill(hf.pid, signal.SIGKILL)
    time.sleep(0.5)
    (run,) = compare(_spec(tiny_bos, text="A new text after the crash."), store=store)
    assert store.has(run.run_id) and all(w.pid != hf.pid for w in pool.running())


def _run_catching(errors, spec, ctx):
    try:
        compare(spec, ctx)
    except Exception as exc:
        errors.append(exc)


@engine
def test_eight_concurrent_clients(home, tiny_bos):
    """4 identical requests and 4 different ones at once: all answered, the identical one computed once,
    one engine per backend, no errors."""
    store = Store(home)
    before = {w.pid for w in pool.running()}
    texts = ["The same request from four users."] * 4 + [f"User {i} asks something else entirely." for i in range(4)]
    results, events = [None] * 8, [[] for _ in range(8)]

    def client(i):
        results[i] = compare(_spec(tiny_bos, text=texts[i]), store=store, on_event=lambda *e: events[i].append(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert all(r is not None for r in results)
    same = {r[0].run_id for r in results[:4]}
    assert len(same) == 1
    computed = sum(any(e[0] == "store" for e in ev) for ev in events[:4])
    assert computed == 1, [[e[0] for e in ev] for ev in events[:4]]
    assert len({r[0].run_id for r in results}) == 5 and len(store.list_runs()) == 5
    # one engine per backend served all eight: at most one new host of each started during the test
    started = [w for w in pool.running() if w.pid not in before]
    assert sorted(w.label for w in started) in ([], ["hf (float32)"], ["vllm (float32)"], ["hf (float32)", "vllm (float32)"]), [
        w.label for w in started
    ]


@engine
def test_engine_start_timeout(home, tiny_bos, monkeypatch, cold_start):
    """A cold start (a pool of its own: no spare that did its imports, which could load within the
    limit) that passes LPP_ENGINE_START_TIMEOUT is stopped and said, and nothing is stored."""
    from logprob_parity.analysis.request import Context

    monkeypatch.setenv("LPP_ENGINE_START_TIMEOUT", "3")
    cold = pool.EnginePool()
    try:
        # the load gets what is left of the 3 s once the host has connected: "longer than 2 s" on a busy machine
        with pytest.raises(EngineError, match=r"within 3 s|longer than [1-3] s loading the model"):
            compare(_spec(tiny_bos, seed=2001), Context.of(store=Store(home), pool=cold))
        assert not [w for w in cold.running() if w.info is None]
    finally:
        cold.shutdown(grace=2.0)
    assert run_files(home) == []


@engine
def test_vllm_not_installed(home, tiny_bos, tmp_path, monkeypatch):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "vllm.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    monkeypatch.setenv("PYTHONPATH", str(shim))
    with pytest.raises(UserError, match=r"not installed .*logprob-parity\[cpu\]"):
        compare(_spec(tiny_bos, seed=2002), store=Store(home))


@engine
def test_out_of_memory_is_named(home, tiny_bos):
    # on CPU, gpu_memory_utilization is the share of RAM vLLM reserves: 0.99 cannot be had
    with pytest.raises(UserError, match="out of memory"):
        compare(_spec(tiny_bos, gpu_memory_utilization=0.99), store=Store(home))
    assert run_files(home) == []


@engine
def test_architecture_vllm_does_not_support(home):
    from builders import build_tiny_openai_gpt

    with pytest.raises(UserError, match="vLLM does not support this model's architecture"):
        compare(_spec(build_tiny_openai_gpt()), store=Store(home))


def test_custom_code_needs_trust(home, tiny_bos, tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    cfg = (
        (Path(tiny_bos) / "config.json")
        .read_text()
        .replace('"model_type"', '"auto_map": {"AutoModelForCausalLM": "m.M"}, "model_type"')
    )
    (folder / "config.json").write_text(cfg)
    with pytest.raises(UserError, match=r"custom code .* trust_remote_code is off"):
        compare(_spec(folder), store=Store(home))


def test_gated_model_message(home, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    class Response:  # the attributes huggingface_hub's HTTP errors read
        headers: ClassVar[dict] = {}
        status_code = 403
        request = None

    def gated(**kw):
        raise GatedRepoError("403 gated", response=Response())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(UserError, match="gated: accept its terms on the Hub and set HF_TOKEN"):
        compare(_spec("meta-llama/Llama-3.2-1B"), store=Store(home))


def test_dtype_the_gpu_cannot_run(monkeypatch):
    from logprob_parity import env

    monkeypatch.setattr(env, "_gpu_query", lambda field: "7.0" if field == "compute_cap" else "Tesla V100")
    assert "bfloat16 needs an Ampere" in env.dtype_support("bfloat16", "cuda")
    assert env.dtype_support("float16", "cuda") is None and env.dtype_support("bfloat16", "cpu") is None


def test_model_roots_limit_local_folders(home, tiny_bos, tmp_path):
    with pytest.raises(UserError, match="limited on this server"):
        compare(_spec(tiny_bos), store=Store(home), model_roots=[str(tmp_path)])
    with pytest.raises(UserError, match="allowed roots: none"):
        compare(_spec("/etc"), store=Store(home), model_roots=[])


def test_too_long_prompt_can_be_truncated(home, tiny_bos):
    from logprob_parity.analysis.request import check_lengths
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.tokens import load_tokenizer, tokenize

    model = resolve_model(str(tiny_bos))
    tok = tokenize(load_tokenizer(str(tiny_bos)), "lawyer guitar hiking family " * 60, "auto")
    with pytest.raises(
        UserError,
        match=r"has 128 positions \(vLLM keeps one for the token it generates\)\. Shorten it, or tick 'Truncate prompts",
    ):
        check_lengths([tok], model, 5)
    (cut,) = check_lengths([tok], model, 5, truncate=True)
    assert len(cut.token_ids) == 127 and cut.token_ids == tok.token_ids[:127] and tok.text.startswith(cut.text)
    assert cut.cut_from == len(tok.token_ids) > 127  # the view can say how much was cut
    # and both engines score the longest prompt the model allows
    (run,) = compare(RunSpec(texts=(tok.text,), model=str(tiny_bos), dtypes=("float32",), truncate=True), store=Store(home))
    assert len(run.sequences[0].token_ids) == 127 and run.summary["n_tokens"] == 126
    assert run.meta.sequences[0].cut_from == len(tok.token_ids)  # recorded with the run, read by the view
    assert Store(home).load(run.run_id).meta.sequences[0].cut_from == len(tok.token_ids)
