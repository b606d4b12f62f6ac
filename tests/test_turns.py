"""Engines in turn: a model whose vLLM and HF engines do not fit on the device together is compared
with each engine alone in its turn, and gives the run the side-by-side comparison gives.

On the CPU a memory cap (the device_memory setting, `--device-memory`) set between one engine's
size and both engines' stands for a card too small for both; the real engines run on the tiny
Llama, and the pool stops the idle engine to make room (a GPU's vLLM sleeps instead: tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import cli_env, kill_after_parts

from logprob_parity.analysis import turns
from logprob_parity.analysis.compare import compare, engine_requests
from logprob_parity.analysis.request import Context, prepare
from logprob_parity.engines import memory
from logprob_parity.engines.records import LoadRequest
from logprob_parity.errors import UserError
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.results.store import Store

TEXTS = (
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "مرحبا بالعالم، هذا نص عربي قصير.",
    "日本語のテキストも少し。 🙂 emoji too.",
    "def double(x):\n    return x * 2\n",
)
LINES = tuple(f"Prompt number {i}: the quick brown fox jumps over the lazy dog {i % 7} times." for i in range(24))


def _sizes(model, texts=TEXTS, dtype="float32") -> tuple[int, int]:
    """(vLLM's, HF's) bytes on the CPU for this request, as the plan reads them."""
    p = prepare(RunSpec(texts=texts, model=str(model), dtypes=(dtype,), device="cpu"), Context.of())
    vreq, hreq = engine_requests(p, dtype)
    return memory.engine_bytes(**_args(vreq)), memory.engine_bytes(**_args(hreq))


def _args(r) -> dict:
    return {
        "backend": r.backend,
        "model_path": r.model_path,
        "dtype": r.dtype,
        "device": r.device,
        "max_model_len": r.max_model_len,
        "settings": r.settings,
    }


def _cap_between(model, texts=TEXTS) -> str:
    """A cap that holds either engine alone but not both."""
    v, h = _sizes(model, texts)
    assert max(v, h) < v + h
    return str((max(v, h) + v + h) // 2)


def test_a_size_is_read_as_people_write_it_and_nonsense_is_refused_in_words():
    assert memory.parse_size("80GB") == 80 * 10**9
    assert memory.parse_size("80 GB") == 80 * 10**9
    assert memory.parse_size("3.5GiB") == int(3.5 * 2**30)
    assert memory.parse_size("512MiB") == 512 * 2**20
    assert memory.parse_size("1000") == 1000
    for bad in ("eighty", "80 XB", "0GB", "-5GB", ""):
        with pytest.raises(UserError, match="device_memory must be"):
            memory.parse_size(bad)
    with pytest.raises(UserError, match="device_memory must be a size such as 80GB"):
        EngineSettings(device_memory="lots").validate()


def test_the_cap_is_a_flag_of_every_command_that_starts_engines_and_stays_out_of_the_run_id():
    from logprob_parity.cli import build_parser

    parser = build_parser()
    for command in ("compare", "diagnose", "rollout", "rescore", "frontier"):
        args = parser.parse_args(
            [command, "--device-memory", "80GB"] + (["--rollouts", "x.jsonl"] if command == "rescore" else [])
        )
        assert args.device_memory == "80GB", command
    assert "device_memory" not in EngineSettings(device_memory="80GB").run_id_part()


def test_groups_cover_every_batch_once_in_order_and_never_hold_more_than_the_bound():
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        bound = rng.randint(1, 120)
        got = turns.groups(sizes, bound)
        assert [i for g in got for i in g] == list(range(len(sizes)))
        for g in got:
            assert len(g) == 1 or sum(sizes[i] for i in g) <= bound  # a batch larger than the bound is alone


def test_a_cap_between_one_engine_and_both_plans_the_engines_in_turn_and_says_why_in_sizes(tiny_bos, home):
    cap = _cap_between(tiny_bos)
    p = prepare(RunSpec(texts=TEXTS, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=cap)), Context.of())
    fit = turns.fit_of(p, *engine_requests(p, "float32"))
    assert fit.in_turn
    assert "the memory cap is" in fit.words and "so the engines will run in turn" in fit.words
    assert f"both need {memory.size_words(fit.vllm_bytes + fit.hf_bytes)}" in fit.words
    roomy = prepare(
        RunSpec(texts=TEXTS, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory="1000GB")),
        Context.of(),
    )
    assert not turns.fit_of(roomy, *engine_requests(roomy, "float32")).in_turn


def test_a_cap_too_small_for_vllm_alone_is_refused_in_words_before_any_engine_starts(tiny_bos, home):
    v, _ = _sizes(tiny_bos)
    ctx = Context.of(store=Store(home))
    before = len(ctx.pool.running())
    spec = RunSpec(texts=TEXTS, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=str(v // 2)))
    with pytest.raises(UserError, match=r"vLLM alone needs .* it cannot be served here, so it cannot be compared here"):
        compare(spec, ctx, use_cache=False)
    assert len(ctx.pool.running()) == before  # refused before any engine started


@pytest.mark.engine
def test_a_comparison_in_turn_is_the_side_by_side_run_and_its_record_says_so(demo_model, home):
    """The demo model under a cap that holds either engine but not both: the exact KL, the floor and
    every value equal the side-by-side run's; the in-turn record says "in turn" and why; at the end
    only one of the two engines holds the device."""
    cap = _cap_between(demo_model)
    ctx = Context.of(store=Store(home / "turns"))
    (side,) = compare(RunSpec(texts=TEXTS, model=str(demo_model), device="cpu"), store=Store(home / "side"), use_cache=False)
    spec = RunSpec(texts=TEXTS, model=str(demo_model), device="cpu", settings=EngineSettings(device_memory=cap))
    (turn,) = compare(spec, ctx, use_cache=False)
    assert turn.run_id == side.run_id  # the cap changes no number, so not the run either
    assert turn.meta.timing["engines"] == "in turn" and "so the engines will run in turn" in turn.meta.timing["engines_why"]
    assert turn.meta.timing["turns"] == 2 and 0 < turn.meta.timing["spool_bytes_max"] <= turn.meta.timing["spool_bound_bytes"]
    assert "engines" not in side.meta.timing
    assert turn.summary == side.summary and turn.summary["kl_full_mean"] is not None
    assert turn.meta.noise["variations"].keys() == side.meta.noise["variations"].keys()
    for a, b in zip(turn.sequences, side.sequences):
        assert a.token_ids == b.token_ids
        for s in ("hf", "vllm"):
            np.testing.assert_array_equal(getattr(a, s).logprob, getattr(b, s).logprob)
        np.testing.assert_array_equal(a.metrics.kl_full, b.metrics.kl_full)
    keys = {r.key() for r in engine_requests(prepare(spec, ctx), "float32")}
    assert len(keys & set(ctx.pool.engine_keys())) == 1  # HF holds the device now; vLLM was stopped for it


@pytest.mark.engine
def test_an_moe_comparison_in_turn_routes_every_token_as_the_side_by_side_run_with_vllms_routes_taken_in_its_own_turn(home):
    """A tiny Qwen3-MoE in turn: vLLM's routes are taken while it holds the device for its scores, so
    the run takes two turns, not three; the routing record and every value equal the side-by-side run's."""
    from families import build_family, family

    model = build_family(family("qwen3_moe"))
    (side,) = compare(RunSpec(texts=TEXTS, model=str(model), device="cpu"), store=Store(home / "side"), use_cache=False)
    spec = RunSpec(texts=TEXTS, model=str(model), device="cpu", settings=EngineSettings(device_memory=_cap_between(model)))
    (turn,) = compare(spec, store=Store(home / "turns"), use_cache=False)
    assert side.meta.routing["measured"] and turn.meta.routing == side.meta.routing
    assert turn.meta.timing["turns"] == 2 and turn.summary == side.summary
    for a, b in zip(turn.sequences, side.sequences):
        np.testing.assert_array_equal(a.vllm.logprob, b.vllm.logprob)
        assert a.routing == b.routing


@pytest.mark.engine
def test_a_prompt_set_in_turn_alternates_in_groups_keeps_its_spool_within_the_bound_and_matches(tiny_bos, home, monkeypatch):
    """Turns of two batches each: the set alternates vLLM, HF, vLLM, HF…, the spool never holds more
    than its bound, and the run is the side-by-side run of the same batches, exact KL and all."""
    monkeypatch.setenv("LPP_BATCH_TOKENS", "160")
    (side,) = compare(RunSpec(texts=LINES, model=str(tiny_bos), device="cpu"), store=Store(home / "side"), use_cache=False)
    batches = side.meta.timing["batches"]
    assert batches >= 4
    monkeypatch.setenv("LPP_TURN_POSITIONS", "320")  # two batches a turn
    spec = RunSpec(
        texts=LINES, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=_cap_between(tiny_bos, LINES))
    )
    (turn,) = compare(spec, store=Store(home / "turns"), use_cache=False)
    t = turn.meta.timing
    assert t["engines"] == "in turn" and t["batches"] == batches
    assert t["turns"] >= 4 and "kl_sample" not in t  # at least two groups: vLLM, HF, vLLM, HF; every row fit
    assert 0 < t["spool_bytes_max"] <= t["spool_bound_bytes"]
    assert turn.summary == side.summary
    for a, b in zip(turn.sequences, side.sequences):
        np.testing.assert_array_equal(a.vllm.logprob, b.vllm.logprob)
        np.testing.assert_array_equal(a.metrics.kl_full, b.metrics.kl_full)


@pytest.mark.engine
def test_past_the_spools_bound_the_exact_kl_covers_a_uniform_sample_equal_where_taken_and_says_so(tiny_bos, home, monkeypatch):
    """A spool that holds a quarter of vLLM's rows: one turn each, the rows of every k-th position of
    each text are kept (never more than the bound), the KL there equals the side-by-side KL bit for
    bit, the other positions have none, and the run states the sample and the mean's standard error."""
    (side,) = compare(RunSpec(texts=LINES, model=str(tiny_bos), device="cpu"), store=Store(home / "side"), use_cache=False)
    vocab = prepare(RunSpec(texts=LINES, model=str(tiny_bos), device="cpu"), Context.of()).model.vocab_size
    rows = sum(s.n_positions for s in side.meta.sequences)
    monkeypatch.setenv("LPP_SPOOL_BYTES", str(rows * 4 * vocab // 4))
    spec = RunSpec(
        texts=LINES, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=_cap_between(tiny_bos, LINES))
    )
    (turn,) = compare(spec, store=Store(home / "turns"), use_cache=False)
    t = turn.meta.timing
    ((stride, phase),) = t["kl_sample"]
    assert stride >= 4 and t["turns"] == 2 and 0 < t["spool_bytes_max"] <= t["spool_bound_bytes"]
    words = turn.meta.env.vllm_engine["kl_full"]
    assert "uniform sample" in words and f"every {stride}th position" in words and "standard error" in words
    kept, got, want = 0, [], []
    for a, b in zip(turn.sequences, side.sequences):
        kl_a, kl_b = np.asarray(a.metrics.kl_full), np.asarray(b.metrics.kl_full)
        rows_kept = np.zeros(len(kl_a), dtype=bool)
        rows_kept[1:] = np.arange(len(kl_a) - 1) % stride == phase  # position t+1 is row t
        np.testing.assert_array_equal(kl_a[rows_kept], kl_b[rows_kept])
        assert np.isnan(kl_a[~rows_kept]).all()
        kept += int(rows_kept.sum())
        got.append(kl_a[rows_kept])
        want.append(kl_b[rows_kept])
        np.testing.assert_array_equal(a.vllm.logprob, b.vllm.logprob)
    assert t["kl_positions"] == kept and kept * 4 * vocab <= t["spool_bound_bytes"]
    sample = np.concatenate(want)
    assert turn.summary["kl_full_mean"] == pytest.approx(float(sample.mean()), rel=1e-12)
    assert turn.summary["kl_full_mean_err"] == pytest.approx(float(sample.std(ddof=1) / np.sqrt(len(sample))), rel=1e-9)
    for k, v in side.summary.items():  # everything but the exact KL's figures is the side-by-side run's
        if not k.startswith("kl_full"):
            assert turn.summary[k] == v, k


@pytest.mark.engine
def test_a_killed_set_in_turn_resumes_without_recomputing_its_stored_batches(tiny_bos, home, tmp_path):
    """Killed after its first group's batches were stored, the same command computes only the rest,
    still in turn, and gives the side-by-side run."""
    lines = LINES[:12]
    prompts = tmp_path / "set.txt"
    prompts.write_text("\n".join(lines) + "\n")
    env = dict(cli_env(home), LPP_BATCH_TOKENS="160", LPP_TURN_POSITIONS="320")  # two batches a turn
    cmd = [sys.executable, "-m", "logprob_parity.cli", "compare", "--model", str(tiny_bos), "--prompts", str(prompts)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--device-memory", _cap_between(tiny_bos, lines)]
    stored = kill_after_parts(cmd, env, home, 2)
    again = subprocess.run(
        cmd + ["--json", str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{stored} of " in again.stderr and "batches came from the store" in again.stderr, again.stderr[-3000:]
    assert "so the engines will run in turn" in again.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    run = Store(home).load(data["run_id"])
    assert run.meta.timing["batches_from_store"] == stored and run.meta.timing["engines"] == "in turn"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LPP_BATCH_TOKENS", "160")
        (side,) = compare(RunSpec(texts=lines, model=str(tiny_bos), device="cpu"), store=Store(home / "side"), use_cache=False)
    assert run.run_id == side.run_id and run.summary == side.summary


def test_a_batch_whose_rows_exceed_the_spool_is_scored_without_the_exact_kl_and_says_why():
    from logprob_parity.engines import fullvocab

    ex = fullvocab.Exchange(100, 1000, "cpu", kind="files", bound=100 * 1000 * 4 - 1)
    assert ex.why is not None and "more than the spool may hold" in ex.why and ex.vllm_target is None
    ex.close()
    ok = fullvocab.Exchange(100, 1000, "cpu", kind="files", bound=100 * 1000 * 4)
    try:
        assert ok.why is None and ok.folder is not None
    finally:
        ok.close()


def test_under_a_cap_on_a_gpu_the_pool_puts_the_idle_engine_to_sleep_and_wakes_it_for_its_next_turn(tiny_bos, monkeypatch):
    """Fake engines on a "cuda" device (no model, real processes): each lease of one engine alone puts
    the other to sleep rather than stopping it, so each turn after the first keeps its process and
    its load; a sleeping engine is woken before it scores (the fake refuses to score asleep)."""
    from logprob_parity.engines.pool import EnginePool
    from logprob_parity.engines.records import LoadRequest

    monkeypatch.setenv("LPP_FAKE_ENGINES", "1")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 50)
    probe = [LoadRequest(b, str(tiny_bos), "float32", "cuda", EngineSettings(), 256) for b in ("vllm", "hf")]
    v, h = (memory.engine_bytes(r.backend, r.model_path, r.dtype, "cuda", 256, r.settings) for r in probe)
    asleep = memory.PROCESS_OVERHEAD["cuda"]  # what an engine asleep still holds: its process's CUDA context
    cap = EngineSettings(device_memory=str(max(v, h) + asleep + (min(v, h) - asleep) // 2))  # one awake, one asleep
    vreq, hreq = (LoadRequest(b, str(tiny_bos), "float32", "cuda", cap, 256) for b in ("vllm", "hf"))
    pool = EnginePool()
    try:
        assert not pool.fits_together([vreq, hreq])
        with pool.lease([vreq]) as lease:
            vhost = lease.host(vreq)
            assert len(vhost.score([[1, 5, 9, 4]], 2)) == 1
        with pool.lease([hreq]) as lease:
            hhost = lease.host(hreq)
            assert vhost.alive() and vhost.asleep and not hhost.asleep  # slept, not stopped
            assert len(hhost.score([[1, 5, 9, 4]], 2)) == 1
        pid = vhost.pid
        with pool.lease([vreq]) as lease:
            assert lease.host(vreq) is vhost and vhost.pid == pid and lease.warm(vreq)
            assert not vhost.asleep and hhost.asleep and hhost.alive()
            assert len(vhost.score([[1, 5, 9, 4]], 2)) == 1  # woken before it scores
        assert sorted(pool.engine_keys()) == sorted([vreq.key(), hreq.key()])  # both warm, one asleep
    finally:
        pool.shutdown(grace=2.0)


@pytest.mark.engine
def test_a_rollout_in_turn_samples_and_scores_what_the_side_by_side_rollout_does(tiny_bos, home, monkeypatch):
    """vLLM samples and prefills every batch in its turn, HF rescores them in its own: the same seeded
    tokens, every logprob column and the exact KL equal the rollout with both engines side by side.
    A second run past the spool's bound keeps the exact KL on a uniform sample of positions: equal
    where taken, none elsewhere, and the record says so."""
    from logprob_parity.analysis.rollout import rollout
    from logprob_parity.results.rollout import Sampling

    sampling = Sampling(samples=2, temperature=0.9, top_p=0.9, max_tokens=12, seed=3)
    prompts = ("The capital of France is", "Write one line about the sea:")
    monkeypatch.setenv("LPP_BATCH_TOKENS", "40")  # a batch a prompt, in both runs: vLLM's turn holds both batches
    (side,) = rollout(
        RunSpec(texts=prompts, model=str(tiny_bos), device="cpu"),
        sampling,
        Context.of(store=Store(home / "side")),
        use_cache=False,
    )
    cap = _cap_between(tiny_bos, prompts)
    spec = RunSpec(texts=prompts, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=cap))
    (turn,) = rollout(spec, sampling, Context.of(store=Store(home / "turns")), use_cache=False)
    assert turn.meta.env.vllm_engine["engines"] == "in turn" and "in turn" in turn.meta.env.vllm_engine["engines_why"]
    assert turn.meta.timing["turns"] >= 2 and "turns" not in side.meta.timing
    assert turn.meta.timing["batches"] == side.meta.timing["batches"] == 2
    assert turn.rollout_id == side.rollout_id and turn.meta.summary == side.meta.summary
    for a, b in zip(turn.samples, side.samples):
        assert a.completion_token_ids == b.completion_token_ids
        for k in b.logprob:
            np.testing.assert_array_equal(a.logprob[k], b.logprob[k])
        np.testing.assert_array_equal(a.exact["kl_full"], b.exact["kl_full"])

    vocab = prepare(spec, Context.of()).model.vocab_size
    rows = sum(len(x.prompt_token_ids) + len(x.completion_token_ids) - 1 for x in side.samples)
    monkeypatch.setenv("LPP_SPOOL_BYTES", str(rows * 4 * vocab // 4))
    (part,) = rollout(spec, sampling, Context.of(store=Store(home / "sampled")), use_cache=False)
    words = part.meta.env.vllm_engine["kl_full"]
    stride, phase = (int(x) for x in re.search(r"every (\d+)th position of each text from position (\d+)", words).groups())
    phase -= 1
    assert stride >= 4 and "uniform sample" in words and "standard error" in words
    taken = []
    for a, b in zip(part.samples, side.samples):
        n0 = len(a.prompt_token_ids)
        kept = (n0 - 1 + np.arange(len(a.completion_token_ids))) % stride == phase  # token n0+j: row n0+j-1
        np.testing.assert_array_equal(a.exact["kl_full"][kept], b.exact["kl_full"][kept])
        assert np.isnan(a.exact["kl_full"][~kept]).all()
        np.testing.assert_array_equal(a.logprob["hf"], b.logprob["hf"])
        taken.append(b.exact["kl_full"][kept])
    taken = np.concatenate(taken)
    assert len(taken) and part.meta.summary["prefill_vs_hf"]["kl_full_mean"] == pytest.approx(float(taken.mean()), rel=1e-12)


@pytest.mark.engine
def test_a_frontier_configuration_whose_engines_do_not_fit_together_runs_them_in_turn_with_the_side_by_side_gaps(tiny_bos, home):
    """One configuration's vLLM and HF engines and the float64 reference under a cap that holds any one
    of them but not all three: the frontier says it runs them in turn, and each gap to float64 equals
    the side-by-side frontier's (speed is timing, not compared)."""
    from logprob_parity.analysis.frontier import _engines, _requests, frontier, parse_configs
    from logprob_parity.engines.pool import engine_bytes

    configs = parse_configs("bfloat16")
    texts = ("The capital of France is Paris, and the capital of Italy is Rome.",)
    side = frontier(
        RunSpec(texts=texts, model=str(tiny_bos), device="cpu"),
        configs,
        Context.of(store=Store(home / "side")),
        speed_load=(2, 16),
    )
    p = prepare(RunSpec(texts=texts, model=str(tiny_bos), device="cpu"), Context.of())
    ref = LoadRequest("hf", p.model.path, "float64", "cpu", p.spec.settings, p.max_model_len)
    total = sum(engine_bytes(r) for r in _engines(p, configs, ref))
    said: list[str] = []
    spec = RunSpec(texts=texts, model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=str(total - 1)))
    turn = frontier(
        spec, configs, Context.of(store=Store(home / "turns"), on_event=lambda *a: said.append(str(a))), speed_load=(2, 16)
    )
    assert any("do not fit together, so they run in turn" in s for s in said), said
    (a,), (b,) = turn.configs, side.configs
    assert a["ref_gap"] == b["ref_gap"] and a["hf_ref_gap"] == b["hf_ref_gap"] and a["tokens_per_s"]["prefill"] > 0
    assert max(engine_bytes(r) for r in _requests(p, configs[0], p.max_model_len)) < total - 1


@pytest.mark.engine
def test_a_rescore_in_turn_gives_the_side_by_side_rescore(tiny_bos, home, tmp_path, monkeypatch):
    """Logged rollouts rescored in turn: vLLM prefills every batch of a group, then HF finishes them
    (two turns for the batches, not two a batch), and every value equals the side-by-side rescore's. Past
    the spool's bound the exact KL keeps a uniform sample of positions, equal where taken."""
    from logprob_parity.analysis.rescore import rescore

    rng = np.random.default_rng(1)
    records = [
        {
            "prompt_token_ids": [0, *rng.integers(40, 500, 6).tolist()],
            "completion_token_ids": rng.integers(40, 500, 10).tolist(),
            "logprobs": (-rng.random(10) * 3).tolist(),
        }
        for _ in range(8)
    ]
    path = tmp_path / "logged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setenv("LPP_BATCH_TOKENS", "40")  # four batches, in both runs
    (side,) = rescore(
        path,
        path.name,
        RunSpec(texts=("x",), model=str(tiny_bos), device="cpu"),
        Context.of(store=Store(home / "side")),
        use_cache=False,
    )
    cap = _cap_between(tiny_bos, ("x" * 40,))
    spec = RunSpec(texts=("x",), model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=cap))
    (turn,) = rescore(path, path.name, spec, Context.of(store=Store(home / "turns")), use_cache=False)
    assert turn.meta.env.vllm_engine["engines"] == "in turn" and side.meta.timing["batches"] == 4
    assert 2 <= turn.meta.timing["turns"] < 2 * 4  # the floors take turns of their own
    assert turn.rollout_id == side.rollout_id and turn.meta.summary == side.meta.summary
    for a, b in zip(turn.samples, side.samples):
        for k in b.logprob:
            np.testing.assert_array_equal(a.logprob[k], b.logprob[k])
        np.testing.assert_array_equal(a.exact["kl_full"], b.exact["kl_full"])

    vocab = prepare(spec, Context.of()).model.vocab_size
    monkeypatch.setenv("LPP_SPOOL_BYTES", str(8 * 16 * 4 * vocab // 4))  # a quarter of the rows
    (part,) = rescore(path, path.name, spec, Context.of(store=Store(home / "sampled")), use_cache=False)
    words = part.meta.env.vllm_engine["kl_full"]
    stride, phase = (int(x) for x in re.search(r"every (\d+)th position of each text from position (\d+)", words).groups())
    assert stride >= 4 and "uniform sample" in words and "standard error" in words
    taken = []
    for a, b in zip(part.samples, side.samples):
        n0 = len(a.prompt_token_ids)
        kept = (n0 - 1 + np.arange(len(a.completion_token_ids))) % stride == phase - 1
        np.testing.assert_array_equal(a.exact["kl_full"][kept], b.exact["kl_full"][kept])
        assert np.isnan(a.exact["kl_full"][~kept]).all()
        taken.append(b.exact["kl_full"][kept])
    taken = np.concatenate(taken)
    assert len(taken) and part.meta.summary["prefill_vs_hf"]["kl_full_mean"] == pytest.approx(float(taken.mean()), rel=1e-9)


def test_the_layer_part_in_turn_is_refused_in_words_before_any_engine_starts(tiny_bos, home):
    """The layer part compares both engines' vectors at once: it cannot run in turn, and says so."""
    from logprob_parity.analysis.diagnostics import diagnose

    ctx = Context.of(store=Store(home))
    before = len(ctx.pool.running())
    spec = RunSpec(
        texts=TEXTS[:1], model=str(tiny_bos), device="cpu", settings=EngineSettings(device_memory=_cap_between(tiny_bos))
    )
    with pytest.raises(UserError, match=r"the layer part compares .* both engines must hold the device together.*run in turn"):
        diagnose(spec, ctx, parts=("layers",))
    assert len(ctx.pool.running()) == before


@pytest.mark.engine
def test_diagnostics_in_turn_measure_the_noise_and_the_reference_the_side_by_side_run_measures(tiny_bos, home):
    """Each engine's own variations need only that engine: in turn, every noise row and the float64
    reference come out as they do side by side."""
    from logprob_parity.analysis.diagnostics import diagnose

    parts = ("noise", "reference")
    side = diagnose(
        RunSpec(texts=TEXTS[:2], model=str(tiny_bos), device="cpu"), Context.of(store=Store(home / "side")), parts=parts
    )
    spec = RunSpec(
        texts=TEXTS[:2],
        model=str(tiny_bos),
        device="cpu",
        settings=EngineSettings(device_memory=_cap_between(tiny_bos, TEXTS[:2])),
    )
    turn = diagnose(spec, Context.of(store=Store(home / "turns")), parts=parts)
    assert Store(home / "turns").load(turn.run_ids["float32"]).meta.timing["engines"] == "in turn"
    a, b = turn.dtypes["float32"], side.dtypes["float32"]
    assert a.noise.keys() == b.noise.keys() and a.noise == b.noise
    assert a.reference == b.reference


def test_a_spool_or_a_sleeping_engine_that_would_not_fit_is_refused_in_words_before_anything_loads_unless_idle_slept_engines_make_room(
    tiny_bos, home, monkeypatch
):
    """Words before work: the spool's rows against the free room of /dev/shm and the temp folder, and on a
    GPU the sleeping engine's weights against host memory, less what a slept engine of this run holds
    already; idle slept engines of another run are stopped for the room, and the run says so."""
    said: list[str] = []
    p = prepare(
        RunSpec(texts=LINES, model=str(tiny_bos), device="cpu"),
        Context.of(on_event=lambda stage, dtype, detail: said.append(detail)),
    )
    vreq, _ = engine_requests(p, "float32")
    rows = sum(len(s) - 1 for s in p.seqs) * 4 * p.model.vocab_size
    turns.make_room(p, vreq, {"spool": rows, "host": 0})  # room enough; a CPU keeps no engine asleep
    with pytest.raises(UserError, match=r"spool .* but /dev/shm and the temp folder have .* free; lower LPP_SPOOL_BYTES"):
        turns.make_room(p, vreq, {"spool": rows - 1, "host": 1 << 40})
    monkeypatch.setenv("LPP_SPOOL_BYTES", str(rows // 10))  # past the bound a sample: a tenth of the rows is all it needs
    turns.make_room(p, vreq, {"spool": rows // 10, "host": 1 << 40})
    monkeypatch.setattr(p, "device", "cuda")
    with pytest.raises(UserError, match=r"the sleeping engine's weights in host memory .* this machine has .* free"):
        turns.make_room(p, vreq, {"spool": rows, "host": 1000})
    # a second run on the same warm engines: the slept vLLM's weights are already in host memory (and
    # out of its free bytes), so they are not asked for again (seen on an H100: 19 GB free of 125 beside them);
    # warm but never slept, its first sleep still needs the room
    with p.ctx.pool.lease([vreq]) as lease:
        with pytest.raises(UserError, match=r"the sleeping engine's weights in host memory"):
            turns.make_room(p, vreq, {"spool": rows, "host": 1000})
        lease.host(vreq).slept = True  # what a sleep on a GPU records (a CPU engine stops instead of sleeping)
        turns.make_room(p, vreq, {"spool": rows, "host": 1000})
        # another run's engine of the same model (a rollout after a comparison: its own context length):
        # while the slept one is leased it is not stopped, and the room is not there
        other = dataclasses.replace(vreq, max_model_len=vreq.max_model_len * 2)
        with pytest.raises(UserError, match=r"the sleeping engine's weights in host memory"):
            turns.make_room(p, other, {"spool": rows, "host": 1000})
    slept = p.ctx.pool.host_for(vreq)
    with pytest.raises(UserError, match=r"the sleeping engine's weights in host memory"):  # nor when the run keeps it
        turns.make_room(p, other, {"spool": rows, "host": 1000}, keep={vreq.key()})
    assert slept.alive()
    # idle, it is stopped to make the room, and the run says so
    turns.make_room(p, other, {"spool": rows, "host": 1000})
    assert not slept.alive() and p.ctx.pool.host_for(vreq) is None
    assert any("stopping 1 idle engine(s) of an earlier run" in s for s in said), said


def test_a_diagnosis_rollout_or_frontier_in_turn_is_estimated_with_its_turns_and_one_side_by_side_without(tiny_bos, home):
    """The forms' estimates before Run count the engines' turns (a CPU: an engine start each; a GPU: the
    weights' sleep and wake at the measured rate) when the cap puts them in turn, and none without a cap."""
    from logprob_parity.analysis.estimate import diagnostics_estimate, frontier_estimate, rollout_estimate

    weights = turns.in_turn_weights(str(tiny_bos), ["float32"], _cap_between(tiny_bos), None, "cpu")
    assert weights == memory.weight_bytes(str(tiny_bos), "float32") > 0
    assert turns.in_turn_weights(str(tiny_bos), ["float32"], None, None, "cpu") == 0
    assert turns.in_turn_weights(str(tiny_bos), ["float32"], "not a size", None, "cpu") == 0  # a form mid-keystroke
    plain, plain_words, _ = diagnostics_estimate("cpu", ["noise"], 1, 0, 0)
    turned, words, _ = diagnostics_estimate("cpu", ["noise"], 1, 0, 0, weights)
    assert "turns of the engines" in words and "turns" not in plain_words and turned > plain
    _, gpu_words, _ = diagnostics_estimate("cuda", ["noise"], 1, 0, 0, 46 * 10**9)
    assert "4 turns of the engines (each a sleep and a wake, about 5 s for 46 GB of weights)" in gpu_words
    plain, plain_words = rollout_estimate("cpu", 2, 2, 16, 1, False, 0)
    turned, words = rollout_estimate("cpu", 2, 2, 16, 1, False, 0, weights)
    assert "2 turns of the engines" in words and "turns" not in plain_words and turned > plain
    plain, plain_words = frontier_estimate("cpu", 2, 0)
    turned, words = frontier_estimate("cpu", 2, 0, 3, weights)
    assert "6 turns of the engines" in words and "turns" not in plain_words and turned > plain


def test_a_vllm_that_sleeps_on_a_gpu_pins_its_host_memory_by_threads_and_keeps_the_users_allocator_settings(monkeypatch):
    """A vLLM started with sleep mode (a GPU under a cap) gets torch's threaded pinned allocation (its first
    sleep of a 46 GB model: 26.9 s the plain way, 7.6 s this way, on an H100); the user's own allocator
    settings stay, under the name they used; a CPU engine, an engine without a cap and HF get nothing."""
    from logprob_parity.engines.records import PINNED_REGISTER

    capped = EngineSettings(device_memory="80GB")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert LoadRequest("vllm", "m", "bfloat16", "cuda", capped).host_env() == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_REGISTER}
    for other in (
        LoadRequest("vllm", "m", "bfloat16", "cpu", capped),
        LoadRequest("vllm", "m", "bfloat16", "cuda", EngineSettings()),
        LoadRequest("hf", "m", "bfloat16", "cuda", capped),
    ):
        assert "PYTORCH_CUDA_ALLOC_CONF" not in other.host_env(), other
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert LoadRequest("vllm", "m", "bfloat16", "cuda", capped).host_env() == {
        "PYTORCH_CUDA_ALLOC_CONF": f"max_split_size_mb:512,{PINNED_REGISTER}"
    }
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_use_cuda_host_register:False")  # the user chose: left alone
    assert LoadRequest("vllm", "m", "bfloat16", "cuda", capped).host_env() == {}
