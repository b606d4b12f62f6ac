"""The foundations other features stand on: the settings registry, the one request path, the
engine pool's counted leases (on the fake backend, in seconds), and thread-safe first imports."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import pytest
from conftest import cli_env
from streamlit.testing.v1 import AppTest

from logprob_parity.analysis.compare import compare, run_id_for
from logprob_parity.analysis.diagnostics import diagnose
from logprob_parity.engines.pool import SWAP_ENV, EnginePool
from logprob_parity.engines.records import LoadRequest
from logprob_parity.errors import UserError
from logprob_parity.inputs.settings import SETTINGS, Setting, settings_class
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.results.store import Store

NEW = Setting("demo_knob", int, 7, "vllm", "a setting that exists only in this test", label="vLLM demo_knob", minimum=1)


def test_a_setting_added_to_the_registry_alone_reaches_help_form_and_run_id(tiny_bos, home):  # home: the build's answer, kept
    from logprob_parity.cli import _settings, build_parser
    from logprob_parity.inputs.models import resolve_model
    from logprob_parity.inputs.tokens import load_tokenizer, tokenize

    registry = SETTINGS + (NEW,)
    parser = build_parser(registry)
    compare_help = parser._subparsers._group_actions[0].choices["compare"].format_help()
    assert "--demo-knob" in compare_help and "a setting that exists only in this test" in compare_help
    args = parser.parse_args(["compare", "--prompt", "x", "--demo-knob", "9"])
    nine = _settings(args, registry)
    assert nine.demo_knob == 9 and nine.vllm_part()["demo_knob"] == 9 and "demo_knob" not in nine.hf_part()

    # the run id moves with the new setting's value
    cls = settings_class(registry)
    model = resolve_model(str(tiny_bos))
    toks = [tokenize(load_tokenizer(str(tiny_bos)), "Shall I compare thee", "auto")]
    ids = {
        v: run_id_for(RunSpec(texts=("Shall I compare thee",), settings=cls(demo_knob=v)), model, "float32", "cpu", toks, 256)
        for v in (7, 9)
    }
    assert ids[7] != ids[9]

    # the Engine settings form draws it, and what is entered comes back under its name
    def page():
        import streamlit as st

        from logprob_parity.dashboard.components.settings_form import settings_inputs
        from logprob_parity.inputs.settings import SETTINGS, Setting

        new = Setting("demo_knob", int, 7, "vllm", "a setting that exists only in this test", label="vLLM demo_knob", minimum=1)
        st.session_state["values"] = settings_inputs("t", registry=SETTINGS + (new,))

    at = AppTest.from_function(page, default_timeout=30).run()
    field = next(n for n in at.number_input if n.label == "vLLM demo_knob")
    assert field.value == 7
    field.set_value(11).run()
    assert at.session_state["values"]["demo_knob"] == 11 and at.session_state["values"]["enforce_eager"] is True


def test_registry_types_are_checked_with_the_settings_name():
    cls = settings_class(SETTINGS)
    with pytest.raises(UserError, match="hf_batch_size must be at least 1"):
        cls(hf_batch_size=0).validate()
    with pytest.raises(UserError, match="attention_backend must be one of"):
        cls(attention_backend="NOPE").validate()
    with pytest.raises(UserError, match="enforce_eager must be bool"):
        cls(enforce_eager="yes").validate()


def test_vllm_gets_every_set_passthrough_setting_by_name():
    cls = settings_class(SETTINGS)
    s = cls(max_num_seqs=4, attention_backend="FLEX_ATTENTION", attn_implementation="eager")
    vllm = s.passthrough("vllm")
    assert vllm["max_num_seqs"] == 4 and vllm["attention_backend"] == "FLEX_ATTENTION" and vllm["enforce_eager"] is True
    assert "attn_implementation" not in vllm and "max_num_batched_tokens" not in vllm  # HF's, and unset
    assert s.passthrough("hf") == {"attn_implementation": "eager", "trust_remote_code": False}


def test_diagnostics_refuse_a_folder_outside_the_allowed_roots(home, tiny_bos, tmp_path):
    """The security hole: diagnostics now take the request path that applies the model roots."""
    spec = RunSpec(texts=("Shall I compare thee to a summer's day?",), model=str(tiny_bos), dtypes=("float32",))
    with pytest.raises(UserError, match="local model folders are limited on this server; allowed roots: none"):
        diagnose(spec, store=Store(home), model_roots=[])
    with pytest.raises(UserError, match="limited on this server"):
        diagnose(spec, store=Store(home), model_roots=[str(tmp_path)])
    assert Store(home).list_runs().empty and Store(home).list_diagnostics().empty


def test_first_transformers_imports_from_three_threads_at_once(tiny_bos, home):
    """Three sessions pressing Run on a fresh server: a bare `from transformers import AutoTokenizer`
    from three threads raised ImportError; load_tokenizer must not."""
    code = f"""
import threading
from logprob_parity.inputs.tokens import load_tokenizer
errors, done = [], []
def go():
    try:
        done.append(len(load_tokenizer({str(tiny_bos)!r})("hello world")["input_ids"]))
    except Exception as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=go) for _ in range(3)]
[t.start() for t in ts]; [t.join() for t in ts]
print("errors", errors); print("done", done)
assert not errors and len(done) == 3
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(home), timeout=300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture()
def fake_engines(monkeypatch):
    """Engine hosts that run the fake backend: real processes and sockets, no model loads."""
    monkeypatch.setenv("LPP_FAKE_ENGINES", "1")
    pool = EnginePool()
    yield pool
    pool.shutdown(grace=2.0)


def test_a_leased_engine_is_never_stopped_and_a_queued_request_says_so(fake_engines, tiny_bos, monkeypatch):
    """Cap 2, three requests of two engines each: while one holds its lease the others wait (and
    say why), whatever the wait; the held hosts stay alive throughout; then each gets its turn."""
    pool = fake_engines
    monkeypatch.setenv("LPP_MAX_WARM_ENGINES", "2")
    reqs = {
        d: [LoadRequest(b, str(tiny_bos), d, "cpu", max_model_len=128) for b in ("vllm", "hf")]
        for d in ("float16", "bfloat16", "float32")
    }
    first = pool.lease(reqs["float16"])
    held = [first.host(r) for r in reqs["float16"]]
    said: dict[str, list[str]] = {"bfloat16": [], "float32": []}
    got: dict[str, list[int]] = {}

    def other(d):
        with pool.lease(reqs[d], on_wait=said[d].append) as lease:
            hosts = [lease.host(r) for r in reqs[d]]
            got[d] = [len(h.score([[1, 5, 9, 11]], 2)) for h in hosts]
            time.sleep(0.5)

    threads = [threading.Thread(target=other, args=(d,)) for d in said]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all(said.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(said.values()), said
    assert all("queued: waiting for 2 engine(s) held by other jobs" in m[0] for m in said.values())
    time.sleep(2.0)
    assert all(h.alive() for h in held) and not got  # nobody took the held engines
    first.release()
    for t in threads:
        t.join(120)
    assert got == {"bfloat16": [1, 1], "float32": [1, 1]}
    assert len(pool.running()) <= 2  # released, then stopped or swapped to hold the others' engines
    assert all(not h.alive() or h.request.dtype != "float16" for h in held)


def test_a_host_stopped_for_room_loads_the_next_engine_in_its_own_process(fake_engines, tiny_bos, monkeypatch):
    """Cap 1: the second model's engine goes into the first one's process (a swap), which keeps its
    imports; an engine of another backend, or with another environment, gets a process of its own."""
    pool = fake_engines
    monkeypatch.setenv("LPP_MAX_WARM_ENGINES", "1")
    a, b = (LoadRequest("vllm", str(tiny_bos), d, "cpu", max_model_len=128) for d in ("float32", "bfloat16"))
    with pool.lease([a]) as lease:
        first = lease.host(a)
        pid = first.pid
    with pool.lease([b]) as lease:
        second = lease.host(b)
        assert second is first and second.pid == pid and second.alive()
        assert second.info["load_timing"]["swapped"] and second.swaps == 1
        assert len(second.score([[1, 5, 9, 11]], 2)) == 1
    hf = LoadRequest("hf", str(tiny_bos), "float32", "cpu", max_model_len=128)
    with pool.lease([hf]) as lease:
        assert lease.host(hf).pid != pid and not first.alive()  # another backend: stopped, a new process
    monkeypatch.setenv(SWAP_ENV, "0")
    with pool.lease([a]) as lease:
        assert lease.host(a).swaps == 0  # swaps turned off: a new process


def test_a_spare_that_did_its_imports_takes_the_next_model(tiny_bos, monkeypatch, cold_start):
    """A pool that keeps spares starts one per backend when a job ends; the next cold engine of that
    backend loads into it (no import), and a spare started for another environment is not used."""
    monkeypatch.setenv("LPP_FAKE_ENGINES", "1")
    pool = EnginePool(keep_spares=True)
    try:
        a, b = (LoadRequest("hf", str(tiny_bos), d, "cpu", max_model_len=128) for d in ("float32", "bfloat16"))
        with pool.lease([a]) as lease:
            lease.host(a)
            assert pool.spares() == []  # made when the job ends, not while it loads
        (spare,) = pool.spares()
        with pool.lease([b]) as lease:
            host = lease.host(b)
            assert host is spare and host.prepared == "hf" and host.loads == 1 and host.swaps == 0
        (again,) = pool.spares()  # the job that took it ended: a new spare
        assert again is not spare
        monkeypatch.setenv("LPP_FAKE_SCORE_S", "0.01")  # another environment than the spare's
        c = LoadRequest("hf", str(tiny_bos), "float16", "cpu", max_model_len=128)
        with pool.lease([c]) as lease:
            assert lease.host(c) is not again
        assert again not in pool.spares()  # replaced by a spare for the new environment
        (newest,) = pool.spares()
    finally:
        pool.shutdown(grace=2.0)
    assert pool.spares() == [] and not newest.alive()


def test_the_device_queue_tells_a_waiting_job_its_place(fake_engines):
    pool = fake_engines
    messages: list[str] = []
    entered = threading.Event()

    def holder():
        with pool.device_turn():
            entered.set()
            time.sleep(1.0)

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(5)
    with pool.device_turn(messages.append, what="hf scoring"):
        pass
    t.join()
    assert messages[0] == "waiting for another job on the device (1 in line) before hf scoring"
    assert messages[1].startswith("the device is free after")


def test_compare_runs_end_to_end_on_fake_engines(fake_engines, tiny_bos, home):
    """The whole request path (resolve, tokenize, lease, score, compare, store) in seconds."""
    from logprob_parity.analysis.request import Context

    events = []
    ctx = Context.of(store=Store(home), on_event=lambda *e: events.append(e), pool=fake_engines)
    (run,) = compare(RunSpec(texts=("Shall I compare thee to a summer's day?",), model=str(tiny_bos), dtypes=("bfloat16",)), ctx)
    assert run.meta.env.hf_engine["backend"] == "fake" and run.summary["n_tokens"] > 5
    assert 0 < run.summary["max_abs_delta"] < 1  # the fake vLLM role adds bfloat16-sized noise
    assert [e[0] for e in events] == ["resolve", "tokenize", "load", "load", "score", "score", "noise", "compare", "store"]
    assert Store(home).load(run.run_id).summary == run.summary


def test_a_request_before_load_is_a_typed_protocol_error_not_an_assert(home):
    """The host answers out-of-turn requests with a ProtocolError (an EngineError: CLI exit 3, a
    message on the page), and a client that lost its host says so instead of asserting."""
    from logprob_parity.engines.host import HostClient
    from logprob_parity.errors import EngineError, ProtocolError

    host = HostClient("hf (float32)").start()
    try:
        host._connect(timeout=60)
        with pytest.raises(ProtocolError, match="hf \\(float32\\): score request before the engine loaded"):
            host.score([[1, 2, 3]], 1)
    finally:
        host.stop(grace=5)
    assert issubclass(ProtocolError, EngineError)
    with pytest.raises(ProtocolError, match="not connected"):
        host.score([[1, 2, 3]], 1)


def test_rollout_and_rescore_defaults_turn_cudnn_attention_off_on_a_gpu_only(monkeypatch):
    """An unset hf_cudnn_attention resolves to False for a rollout or a rescore on a GPU (HF's
    trainer side meets new batch widths in every rollout, and cuDNN plans each one), stays unset on
    a CPU, and an explicit value is kept; CUDA graphs follow the device as before."""
    import dataclasses

    from logprob_parity.analysis import rollout as rollout_mod
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec

    spec = RunSpec(
        texts=("a b c",),
        model="m",
        dtypes=("bfloat16",),
        device="cuda",
        settings=dataclasses.replace(EngineSettings(), enforce_eager=None),
    )
    monkeypatch.setattr(rollout_mod, "resolve_device", lambda d: d)  # a GPU is not needed to resolve settings
    gpu = rollout_mod.with_rollout_defaults(spec).settings
    assert (gpu.hf_cudnn_attention, gpu.enforce_eager) == (False, False)
    assert rollout_mod.with_trainer_defaults(spec).settings.hf_cudnn_attention is False
    assert rollout_mod.with_trainer_defaults(spec).settings.enforce_eager is None  # a rescore samples nothing
    cpu = rollout_mod.with_rollout_defaults(dataclasses.replace(spec, device="cpu")).settings
    assert (cpu.hf_cudnn_attention, cpu.enforce_eager) == (None, True)
    kept = dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, hf_cudnn_attention=True))
    assert rollout_mod.with_rollout_defaults(kept).settings.hf_cudnn_attention is True


@pytest.mark.parametrize("indent", [None, 1, 2])
def test_json_written_an_item_at_a_time_holds_what_json_dumps_holds(indent):
    """write_items (a run's sequences, a rollout's samples, one at a time) writes the object
    json.dumps gives for the whole: empty lists, nested values, non-ASCII text and a key already in
    the head keeping its place. Without an indent it is json.dumps' very text; with one, the head is
    laid out and each item is one line."""
    import io
    import json

    from logprob_parity.results.run import write_items

    for items in ([], [{"a": [1, {"b": 2.5}], "t": "é🎉\n"}, {"c": None}]):
        head = {"x": 1, "samples": [9], "z": {"q": []}}
        f = io.StringIO()
        write_items(f, head, "samples", iter(items), indent)
        text = f.getvalue()
        assert json.loads(text) == {**head, "samples": items}
        assert list(json.loads(text)) == ["x", "samples", "z"]
        if indent is None:
            assert text == json.dumps({**head, "samples": items})
        else:
            lines = text.splitlines()
            assert [json.loads(ln.strip().rstrip(",")) for ln in lines if ln.strip().startswith('{"')] == items
            assert lines[1] == " " * indent + '"x": 1,'


def test_the_prewarm_leaves_the_floors_bundled_texts_scored_on_each_hf_engine(fake_engines, tiny_bos):
    """warm_defaults, as the dashboard's server runs it: besides loading the engines it scores the noise
    floor's bundled texts that a top-up can take alone and chunked on each HF engine (floors.BUNDLED),
    so the first Run's floor finds them, and no text beyond those (no floor adds them); vLLM's engines
    keep nothing there."""
    from logprob_parity.analysis import floors
    from logprob_parity.analysis.prewarm import warm_defaults
    from logprob_parity.analysis.request import Context, prepare

    ctx = Context.of(pool=fake_engines)
    labels = warm_defaults(ctx, str(tiny_bos))
    p = prepare(RunSpec(texts=("x",), model=str(tiny_bos), device="cpu"), ctx)
    hf = [p.load("hf", d) for d in ("bfloat16", "float32")]
    assert {r.label for r in hf} <= set(labels)
    every = floors.other_prompts(p.tokenizer, p.spec.bos, hf[0].max_model_len, "cpu")
    # the most any floor's top-up takes: the first texts, until they hold TAIL_MIN_POSITIONS scored positions
    held = list(itertools.accumulate(len(o) - 1 for o in every))
    others = every[: next(i for i, h in enumerate(held) if h >= floors.TAIL_MIN_POSITIONS) + 1]
    assert 0 < len(others) < len(every)

    def unscored(texts):
        raise AssertionError(f"{len(texts)} bundled texts were not scored by the prewarm")

    with fake_engines.lease([*hf, p.load("vllm", "float32")]) as lease:
        for r in hf:
            host = lease.host(r)
            assert len(floors.BUNDLED.each(host, ("alone",), others, unscored)) == len(others)
            for c in {floors.chunk_of(len(o) - 1) for o in others}:
                some = [o for o in others if floors.chunk_of(len(o) - 1) == c]
                assert len(floors.BUNDLED.each(host, ("chunked", c), some, unscored)) == len(some)
            beyond = every[len(others) :]  # none of them scored: each is computed here (as "missing")
            assert floors.BUNDLED.each(host, ("alone",), beyond, lambda xs: ["missing"] * len(xs)) == ["missing"] * len(beyond)
        with pytest.raises(AssertionError, match="not scored by the prewarm"):
            floors.BUNDLED.each(lease.host(p.load("vllm", "float32")), ("alone",), others, unscored)
