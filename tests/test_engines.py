"""Integration: the real HF model and the real vLLM engine (CPU build) on real token ids."""

import numpy as np
import pytest

from logprob_parity.analysis.compare import compare
from logprob_parity.engines import pool
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.results.store import Store

pytestmark = pytest.mark.engine

TEXTS = (
    "Dave lives in Palm Coast, FL and is a lawyer.",
    "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e, and <script>alert(1)</script>",
)


@pytest.mark.parametrize("model_fixture, tokenizer_adds_bos", [("tiny_bos", True), ("tiny_nobos", False)])
@pytest.mark.parametrize("bos", ["auto", "none"])
def test_same_ids_both_backends(request, home, model_fixture, tokenizer_adds_bos, bos):
    from logprob_parity.inputs.tokens import load_tokenizer
    from logprob_parity.inputs.tokens import tokenizer_adds_bos as adds

    model = request.getfixturevalue(model_fixture)
    assert adds(load_tokenizer(str(model))) is tokenizer_adds_bos
    (run,) = compare(RunSpec(texts=TEXTS, model=str(model), dtypes=("float32",), top_k=4, bos=bos), store=Store(home))
    data = run.to_json_dict()
    for seq, text in zip(data["sequences"], TEXTS):
        ids = seq["token_ids"]
        assert (ids[0] == 0) is (bos == "auto"), ids[:3]
        first = seq["positions"][0]
        assert first["logprob"] == {"hf": None, "vllm": None} and first["delta"] is None
        # both engines scored exactly these ids (checked inside too); every later position has both values
        for s in run.sequences:
            np.testing.assert_array_equal(s.hf.token_ids, s.vllm.token_ids)
        assert all(p["logprob"]["hf"] is not None and p["logprob"]["vllm"] is not None for p in seq["positions"][1:])
        assert "".join(seq_piece for seq_piece in run.sequences[data["sequences"].index(seq)].pieces).endswith(text)
    s = run.summary
    assert s["n_tokens"] == sum(len(q["token_ids"]) - 1 for q in data["sequences"])
    assert s["max_abs_delta"] <= 1e-4, s
    assert s["argmax_agreement"] == 1.0
    # ranks come from each engine independently and agree in float32
    for q in run.sequences:
        np.testing.assert_array_equal(q.hf.rank[1:], q.vllm.rank[1:])


def test_engines_are_reused_and_cache_skips_them(home, tiny_bos):
    store = Store(home)
    spec = RunSpec(texts=("Shall I compare thee to a summer's day?",), model=str(tiny_bos), dtypes=("float32",), top_k=3)
    (first,) = compare(spec, store=store)
    pids = sorted(w.pid for w in pool.running())
    events = []
    (again,) = compare(spec, store=store, on_event=lambda *e: events.append(e))
    assert again.from_store and again.run_id == first.run_id
    assert [e[0] for e in events] == ["resolve", "cache"]
    # a new text on the same model and dtype reuses the warm workers: no new process
    (other,) = compare(RunSpec(texts=("Thou art more lovely.",), model=str(tiny_bos), dtypes=("float32",), top_k=3), store=store)
    assert not other.from_store and other.run_id != first.run_id
    assert sorted(w.pid for w in pool.running()) == pids
    assert other.meta.timing["vllm_load_s"] < 1.0
    # --no-cache recomputes, on the same warm engines, to the same numbers
    (recomputed,) = compare(spec, store=store, use_cache=False)
    np.testing.assert_array_equal(recomputed.sequences[0].metrics.delta, first.sequences[0].metrics.delta)


def test_hf_topk_and_gathered_values_are_consistent(home, tiny_bos):
    (run,) = compare(RunSpec(texts=TEXTS[:1], model=str(tiny_bos), dtypes=("float32",), top_k=5), store=Store(home))
    s = run.sequences[0]
    # HF's values on vLLM's top-k ids equal vLLM's own top-k values to float32 noise
    np.testing.assert_allclose(s.hf.gathered_logprobs[1:], s.vllm.topk_logprobs[1:], atol=1e-4)
    # top-k lists are sorted and the target's logprob is consistent with its rank
    assert np.all(np.diff(s.hf.topk_logprobs[1:], axis=1) <= 0)
    for t in range(1, len(s.token_ids)):
        if s.vllm.rank[t] <= 5:
            assert s.token_ids[t] in s.vllm.topk_ids[t]


def test_hf_row_chunking_changes_no_value(tiny_bos):
    """The HF backend in-process (plumbing of its own arithmetic): chunked rows == one block, bit for bit."""
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.inputs.spec import EngineSettings

    hf = HFBackend(str(tiny_bos), "float32", "cpu", EngineSettings(), 128)
    ids = [0] + list(range(5, 105))
    gather = np.tile(np.arange(4), (len(ids), 1))
    whole = hf.score([ids], 4, [gather])[0]
    hf.ROW_CHUNK = 7
    parts = hf.score([ids], 4, [gather])[0]
    for f in ("logprob", "rank", "topk_ids", "topk_logprobs", "gathered_logprobs"):
        np.testing.assert_array_equal(getattr(whole, f), getattr(parts, f))


def test_hf_batches_keep_order_and_values(tiny_bos):
    """hf_batch_size > 1 sorts by length, pads, and puts every result back in its place; on this CPU
    float32 values move by at most batch noise, and blocks of rows across a batch are bit-identical."""
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.inputs.spec import EngineSettings

    seqs = [[0] + list(range(5, 5 + n)) for n in (40, 7, 23, 40, 1)]
    gathers = [np.tile(np.arange(3), (len(s), 1)) for s in seqs]
    one = HFBackend(str(tiny_bos), "float32", "cpu", EngineSettings(), 128).score(seqs, 3, gathers)
    hf = HFBackend(str(tiny_bos), "float32", "cpu", EngineSettings(hf_batch_size=4), 128)
    batched = hf.score(seqs, 3, gathers)
    hf.ROW_CHUNK = 5
    blocked = hf.score(seqs, 3, gathers)
    for s, a, b, c in zip(seqs, one, batched, blocked):
        np.testing.assert_array_equal(b.token_ids, s)
        np.testing.assert_allclose(b.logprob[1:], a.logprob[1:], atol=1e-5)
        np.testing.assert_allclose(b.gathered_logprobs[1:], a.gathered_logprobs[1:], atol=1e-5)
        for f in ("logprob", "rank", "topk_ids", "topk_logprobs", "gathered_logprobs"):
            np.testing.assert_array_equal(getattr(b, f), getattr(c, f))
        assert np.isnan(b.logprob[0]) and np.all(np.isnan(b.gathered_logprobs[0]))


def test_hf_compile_scores_the_same_positions(tiny_bos):
    """hf_compile runs the forward and the logprob blocks through torch.compile (inductor): on this
    CPU in float32 the values stay within float32 fusion noise of eager and the ranks and top-k
    ids are the same, in input order, across a padded batch and an unpadded one."""
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.inputs.spec import EngineSettings

    seqs = [[0] + list(range(5, 5 + n)) for n in (40, 7, 23, 40)]
    gathers = [np.tile(np.arange(3), (len(s), 1)) for s in seqs]
    eager = HFBackend(str(tiny_bos), "float32", "cpu", EngineSettings(hf_batch_size=2), 128)
    comp = HFBackend(str(tiny_bos), "float32", "cpu", EngineSettings(hf_batch_size=2, hf_compile=True), 128)
    assert comp._forward_model is not comp.model and eager._forward_model is eager.model
    for a, b in zip(eager.score(seqs, 3, gathers), comp.score(seqs, 3, gathers)):
        np.testing.assert_array_equal(b.token_ids, a.token_ids)
        np.testing.assert_allclose(b.logprob[1:], a.logprob[1:], atol=1e-4)
        np.testing.assert_allclose(b.gathered_logprobs[1:], a.gathered_logprobs[1:], atol=1e-4)
        np.testing.assert_allclose(b.topk_logprobs[1:], a.topk_logprobs[1:], atol=1e-4)
        np.testing.assert_array_equal(b.rank[1:], a.rank[1:])
        np.testing.assert_array_equal(b.topk_ids[1:], a.topk_ids[1:])


def _idle_hf(engines, tiny_bos, **settings):
    """A loaded HF host of `engines` (a pool) that no request holds, last used 5 s ago."""
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.spec import EngineSettings

    load = LoadRequest("hf", str(tiny_bos), "float32", "cpu", EngineSettings(**settings), 256)
    with engines.lease([load]) as lease:
        worker = lease.host(load)
    worker.last_used -= 5.0
    return worker, load


@pytest.fixture()
def own_pool():
    """A pool of this test's own: stopping its idle engines leaves the session's warm engines alone."""
    engines = pool.EnginePool()
    yield engines
    engines.shutdown(grace=2.0)


def test_idle_engines_stop_after_the_timeout(own_pool, tiny_bos, monkeypatch):
    worker, _ = _idle_hf(own_pool, tiny_bos)
    monkeypatch.setenv(pool.IDLE_TIMEOUT_ENV, "3600")
    assert own_pool.reap_idle() == 0 and worker.alive()
    monkeypatch.setenv(pool.IDLE_TIMEOUT_ENV, "2")
    assert own_pool.reap_idle() == 1
    assert not worker.alive() and worker not in own_pool.running()
    assert own_pool._reaper is not None and own_pool._reaper.is_alive()


def test_a_new_engine_that_does_not_fit_stops_idle_ones(own_pool, tiny_bos, monkeypatch):
    """Memory-aware eviction: when free memory is short, idle warm engines go, least recently used
    first; the process of the one that went may load the new engine (a swap), but holds only that."""
    from logprob_parity.engines import memory

    old, _ = _idle_hf(own_pool, tiny_bos, attn_implementation="eager")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 0)
    new, new_load = _idle_hf(own_pool, tiny_bos, attn_implementation="sdpa")
    assert own_pool.engine_keys() == [new_load.key()] and new.alive()
    assert new.request == new_load and (new is old or not old.alive())


def test_fits_together_counts_cold_engines_and_reclaimable_ones(tiny_bos, monkeypatch):
    from logprob_parity.engines import memory
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.spec import EngineSettings

    plan = [
        LoadRequest(b, str(tiny_bos), d, "cpu", EngineSettings(hf_batch_size=2), 256)
        for d in ("float32", "bfloat16")
        for b in ("hf", "vllm")
    ]
    need = sum(pool.engine_bytes(r) for r in plan)
    fresh = pool.EnginePool()  # no warm hosts: nothing reclaimable, whatever earlier tests left warm
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)
    assert fresh.fits_together(plan)
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    assert not fresh.fits_together(plan)


SWAP_IDS = [[1, 45, 49, 17, 17, 300, 21, 9, 4], [1, 200, 3, 77]]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_host_that_swaps_models_scores_the_second_exactly_as_a_fresh_host(tiny_bos, demo_model, backend, cold_start):
    """The tiny Llama, then the demo model in the same process (its imports kept): every field of its
    scores equals those of a host started fresh for the demo model, bit for bit."""
    from logprob_parity.engines.host import LAST_START, HostClient
    from logprob_parity.engines.records import LoadRequest

    first, second = (LoadRequest(backend, str(m), "float32", "cpu", max_model_len=128) for m in (tiny_bos, demo_model))
    swapped, fresh = HostClient(f"{backend} swapped").start(), HostClient(f"{backend} fresh").start()
    try:
        swapped.begin_load(first)
        swapped.wait_loaded()
        pid = swapped.pid
        assert len(swapped.score(SWAP_IDS, 3)) == 2
        cold = dict(LAST_START)
        swapped.begin_load(second)
        timing = swapped.wait_loaded()["load_timing"]
        assert swapped.pid == pid and timing["swapped"] and timing["import_s"] < 0.5, timing
        assert cold == LAST_START  # a swap is no cold start: the next estimate does not read it as one
        fresh.begin_load(second)
        t = fresh.wait_loaded()["load_timing"]
        assert not t.get("swapped") and LAST_START[(backend, "cpu")] == t["import_s"] + t["init_s"]
        a, b = swapped.score(SWAP_IDS, 3), fresh.score(SWAP_IDS, 3)
    finally:
        swapped.stop()
        fresh.stop()
    for x, y in zip(a, b):
        for name in ("token_ids", "logprob", "topk_ids", "topk_logprobs", "rank"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=f"{name}: swapped vs fresh")


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_host_forked_from_the_zygote_scores_exactly_as_a_new_process(tiny_bos, backend, monkeypatch):
    """The session's hosts are forked from a zygote that imported the engines once: a forked host
    loads without importing, and every field of its scores equals a host started as a new process,
    bit for bit. Its exit status reaches the pool through the zygote."""
    from logprob_parity.engines.host import HostClient, host_env
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.engines.zygote import ZYGOTE_ENV, ZYGOTE_KEY_ENV, ForkedProcess, Zygote

    request = LoadRequest(backend, str(tiny_bos), "float32", "cpu", max_model_len=128)
    zygote = Zygote().start(host_env({}))  # this test's own, so that it holds without the session's
    try:
        forked = HostClient(f"{backend} forked").start()
        assert isinstance(forked.proc, ForkedProcess), forked.refused_fork
        with monkeypatch.context() as m:  # a new process, as the product starts its hosts
            m.delenv(ZYGOTE_ENV)
            m.delenv(ZYGOTE_KEY_ENV)
            fresh = HostClient(f"{backend} fresh").start()
        assert not isinstance(fresh.proc, ForkedProcess)
        try:
            forked.begin_load(request)
            fresh.begin_load(request)
            t_forked, t_fresh = forked.wait_loaded()["load_timing"], fresh.wait_loaded()["load_timing"]
            assert t_forked["forked"] and t_forked["import_s"] < 0.5 and not t_fresh.get("forked"), (t_forked, t_fresh)
            a, b = forked.score(SWAP_IDS, 3), fresh.score(SWAP_IDS, 3)
        finally:
            forked.stop()
            fresh.stop()
        assert forked.proc.returncode == 0 and fresh.proc.returncode == 0  # closed when asked, both
    finally:
        zygote.stop()
    for x, y in zip(a, b):
        for name in ("token_ids", "logprob", "topk_ids", "topk_logprobs", "rank"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=f"{name}: forked vs new process")


RANKER_CHECK = """
import os
from logprob_parity.engines.host import host_env
os.environ.update(host_env({}))
import torch
from vllm.v1.sample.ops.logprobs import batched_count_greater_than as ranks
from logprob_parity.engines.backends.vllm import VLLMBackend
compiled = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
code = ranks._torchdynamo_orig_callable.__code__
set_to, real_set, real_get = [], torch.set_num_threads, torch.get_num_threads
torch.set_num_threads = set_to.append  # the zygote must never set it (VLLMBackend.prefork says why)
torch.get_num_threads = lambda: 2  # as where OpenMP runs two threads: nothing compiled
VLLMBackend.prefork()
assert len(compiled(code)) == 0, "compiled at two threads"
torch.get_num_threads = real_get
VLLMBackend.prefork()  # what the zygote does before it forks
torch.set_num_threads = real_set
assert set_to == [], f"the zygote set the thread count: {set_to}"
# the platform's Triton kernel stand-ins are registered in the zygote, and an engine's start (which
# asks again, from vLLM's init_worker) scans no module for them again (register_kernels_once)
import vllm.triton_utils.dispatcher as dispatcher
from vllm.platforms import current_platform
from vllm.v1.worker.block_table import ComputeSlotMappingKernel
scans, rebind = [], dispatcher._rebind_kernels
dispatcher._rebind_kernels = lambda overrides: (scans.append(len(overrides)), rebind(overrides))
current_platform.register_triton_kernel_overrides()
dispatcher._rebind_kernels = rebind
assert isinstance(ComputeSlotMappingKernel.kernel, dispatcher.KernelOverride), ComputeSlotMappingKernel.kernel
assert scans == [], f"an engine's start scanned the modules again: {scans}"
before = len(compiled(code))
pid = os.fork()
if pid == 0:  # a forked host: the demo model's, a Llama 2's and a Qwen's vocabulary, 1 to 5 tokens
    for n, vocab in ((1, 49152), (5, 32000), (2, 151936)):
        with torch.inference_mode():  # as vLLM's model runner makes its logprobs and calls it
            x = torch.randn(n, vocab)
            own = x.gather(-1, torch.randint(0, vocab, (n, 1)))
            torch._dynamo.decorators.mark_unbacked(x, 0)
            torch._dynamo.decorators.mark_unbacked(own, 0)
            assert torch.equal(ranks(x, own), (x >= own).sum(-1)), (n, vocab)
    print("compiled graphs: before the fork", before, "after the child's calls", len(compiled(code)), flush=True)
    os._exit(0 if len(compiled(code)) == before > 0 else 3)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_vllms_token_ranker_compiled_in_the_zygote_serves_every_vocabulary_in_a_forked_host_without_compiling_again():
    """vLLM ranks each scored token with a torch.compile'd function that every new engine process
    compiled on its first score (about 2 s of this CPU). The zygote compiles it before it forks
    (VLLMBackend.prefork): a forked host calls it for other vocabularies and token counts, gets the
    counts computed without it, and no graph is compiled again, at one thread as each test worker runs
    (at another thread count the graph's guards ask for a recompile from the cache: 0.12 s, not 2.3 s).
    Where OpenMP runs two threads it compiles nothing, and it never sets the thread count: forked HF
    hosts then raced on the thread pool as they loaded ("Invalid thread pool!"). The platform's kernel
    stand-ins are registered there too, and an engine's start does not scan the modules for them again.
    That a forked host's scores, ranks included, equal a new process's:
    test_a_host_forked_from_the_zygote_scores_exactly_as_a_new_process."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", RANKER_CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert p.returncode == 0 and "child exit 0" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_the_zygote_forks_no_host_whose_environment_differs_in_what_imports_read(monkeypatch, tmp_path):
    """A variable that vLLM or torch may read at import time (here VLLM_LOGGING_LEVEL) makes the
    zygote refuse, naming it, and the host starts as a new process; a variable the project reads when
    it uses it (the store's folder) does not. A forked host killed by a signal reports that signal."""
    import signal

    from logprob_parity.engines.host import HostClient, host_env
    from logprob_parity.engines.zygote import ForkedProcess, Zygote

    zygote = Zygote().start(host_env({}))
    try:
        monkeypatch.setenv("LOGPROB_PARITY_HOME", str(tmp_path))
        same = HostClient("fake").start()
        assert isinstance(same.proc, ForkedProcess), same.refused_fork
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
        other = HostClient("fake").start()
        assert not isinstance(other.proc, ForkedProcess)
        assert other.refused_fork == "its environment differs in VLLM_LOGGING_LEVEL"
        other.stop(grace=0.0)
        same.proc.kill()
        assert same.proc.wait(10) == -signal.SIGKILL
        same.stop(grace=0.0)
    finally:
        zygote.stop()


def test_what_ray_and_streamlit_write_at_run_time_leaves_a_fork_allowed_and_a_preload_does_not():
    """ray.init and Streamlit's start write variables that are read when used, never at import: a test
    process (or dashboard) that ran them still gets forked hosts, and so does a Ray worker, whose raylet
    writes its own. vLLM's CPU platform writes LD_PRELOAD when it configures an engine: that one refuses
    (a fresh host would start with it preloaded)."""
    from logprob_parity.engines.zygote import refusal

    base = {"PATH": "/usr/bin", "HOME": "/root"}
    ran = {"PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace", "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    assert refusal({**base, **ran, "MAPBOX_API_KEY": ""}, base, base) is None
    assert (
        refusal({**base, **ran, "LD_PRELOAD": "libtcmalloc_minimal.so.4"}, base, base) == "its environment differs in LD_PRELOAD"
    )
    # a Ray worker (a host it starts): the raylet's own variables leave the fork allowed, a preload does not
    worker = {"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "4242", "RAY_LD_PRELOAD_ON_WORKERS": "0", "SPT_NOENV": "1"}
    assert refusal({**base, **ran, **worker}, base, base) is None
    assert refusal({**base, **worker, "LD_PRELOAD": "libjemalloc.so"}, base, base) == "its environment differs in LD_PRELOAD"


def test_two_tests_asking_for_one_engine_key_in_a_session_start_it_once(pytester, tiny_bos):
    """Two tests of one pytest session lease the same engine key through the process pool: the first
    starts it, the second finds it warm in the same process; the start log holds one load of it."""
    import json
    import os

    from conftest import start_rows

    key_len = 112  # a context length no other test asks for: a key this session has not loaded
    pytester.makepyfile(
        test_shared=f"""
from logprob_parity.engines.pool import POOL
from logprob_parity.engines.records import LoadRequest

REQ = LoadRequest("vllm", {str(tiny_bos)!r}, "float32", "cpu", max_model_len={key_len})
PIDS = []

def test_first_asks():
    with POOL.lease([REQ]) as lease:
        PIDS.append(lease.host(REQ).pid)
        assert not lease.warm(REQ)
        assert len(lease.host(REQ).score([[1, 5, 9, 11]], 2)) == 1

def test_second_asks_again():
    with POOL.lease([REQ]) as lease:
        assert lease.warm(REQ) and lease.host(REQ).pid == PIDS[0]
        assert len(lease.host(REQ).score([[1, 5, 9, 11]], 2)) == 1
"""
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    rows = start_rows()
    loads = [r for r in rows if r["pid"] == os.getpid() and json.loads(r["key"])["max_model_len"] == key_len]
    assert len(loads) == 1, loads
