"""The exact full-vocabulary KL(HF || vLLM) and llama.cpp's statistics.

The KL is checked against numpy on a tiny-vocabulary model (512 entries), with both full
distributions taken independently of our engines: HF from transformers in this process, vLLM from
its own public API (prompt_logprobs over the whole vocabulary). The statistics are checked against
a hand computation."""

import math
import os

import numpy as np
import pytest

from logprob_parity.results.metrics import TokenMetrics, llama_cpp_stats

TEXT = "The quick brown fox jumps over the lazy dog, twice."


def _metrics(hf_lp, vllm_lp, agree, kl_full):
    hf_lp, vllm_lp = np.asarray(hf_lp, dtype=float), np.asarray(vllm_lp, dtype=float)
    scored = np.isfinite(hf_lp)
    ph, pv = np.exp(hf_lp), np.exp(vllm_lp)
    d = vllm_lp - hf_lp
    return TokenMetrics(
        scored, ph, pv, d, np.abs(d), np.abs(pv - ph), np.zeros(len(d)), np.asarray(agree), np.asarray(kl_full, float)
    )


def test_llama_cpp_statistics_match_a_hand_computation():
    # position 0 unscored; four scored positions
    m = _metrics(
        [np.nan, math.log(0.5), math.log(0.25), math.log(0.8), math.log(0.1)],
        [np.nan, math.log(0.4), math.log(0.25), math.log(0.9), math.log(0.2)],
        [False, True, True, False, True],
        [np.nan, 0.01, 0.0, 0.04, 0.02],
    )
    s = llama_cpp_stats(m)
    kl = np.array([0.01, 0.0, 0.04, 0.02])
    assert s["kl_full_mean"] == pytest.approx(0.0175)
    assert s["kl_full_mean_err"] == pytest.approx(np.std(kl, ddof=1) / 2)
    assert s["kl_full_max"] == pytest.approx(0.04)
    # numpy's linear percentiles of [0, 0.01, 0.02, 0.04]: p50 = 0.015, p90 = 0.02 + 0.7 * 0.02
    assert s["kl_full_p50"] == pytest.approx(0.015) and s["kl_full_p90"] == pytest.approx(0.034)
    assert s["kl_full_p0_1"] == pytest.approx(0.00003) and s["kl_full_p99_9"] == pytest.approx(0.03994)
    for key in ("kl_full_p99", "kl_full_p95", "kl_full_p10", "kl_full_p5", "kl_full_p1"):
        assert s[key] is not None
    assert s["same_top_p"] == pytest.approx(0.75)
    assert s["same_top_p_err"] == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    dp = np.array([0.4 - 0.5, 0.0, 0.9 - 0.8, 0.2 - 0.1])
    assert s["dp_mean"] == pytest.approx(dp.mean()) and s["dp_rms"] == pytest.approx(math.sqrt(np.mean(dp**2)))
    # PPL(vLLM)/PPL(HF) = exp(mean(l_HF - l_vLLM))
    mean = (math.log(0.5 / 0.4) + 0 + math.log(0.8 / 0.9) + math.log(0.1 / 0.2)) / 4
    assert s["ppl_ratio"] == pytest.approx(math.exp(mean))


def test_statistics_without_the_exact_kl_leave_its_keys_empty():
    m = _metrics([np.nan, -1.0, -2.0], [np.nan, -1.0, -2.5], [False, True, True], [np.nan, np.nan, np.nan])
    s = llama_cpp_stats(m)
    assert s["kl_full_mean"] is None and s["kl_full_p50"] is None and s["same_top_p"] == 1.0 and s["ppl_ratio"] > 1


@pytest.mark.engine
def test_exact_kl_equals_a_numpy_full_vocabulary_computation(tiny_bos, home, monkeypatch, vllm_in_this_process):
    import torch
    from transformers import AutoModelForCausalLM

    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec

    def folders() -> set[str]:  # this process's: on two test processes the other may hold one of its own
        mine = f"lpp-fullvocab-{os.getpid()}-"
        return {f for f in os.listdir("/dev/shm") if f.startswith(mine)} if os.path.isdir("/dev/shm") else set()

    before = folders()
    (run,) = compare(RunSpec(texts=(TEXT,), model=str(tiny_bos), dtypes=("float32",), device="cpu"), use_cache=False)
    assert folders() <= before  # this comparison's shared-memory folder is removed after it
    seq = run.sequences[0]
    ids = list(seq.token_ids)
    assert run.meta.env.vllm_engine["kl_full"] == "exact, every position (from vLLM’s v1 model runner)"

    # HF's full distribution, independently
    model = AutoModelForCausalLM.from_pretrained(str(tiny_bos), dtype=torch.float32).eval()
    with torch.inference_mode():
        lh = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1).double().numpy()
    vocab = lh.shape[1]
    assert vocab == 512

    # vLLM's full distribution through its own API: every vocabulary entry's prompt logprob
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(tiny_bos),
        dtype="float32",
        max_model_len=run.meta.settings["max_model_len"],
        max_logprobs=vocab,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
    )
    try:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)],
            SamplingParams(prompt_logprobs=vocab, max_tokens=1, temperature=0.0, detokenize=False),
            use_tqdm=False,
        )[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    lv = np.full((len(ids) - 1, vocab), np.nan)
    for t, pos in enumerate(out.prompt_logprobs[1:]):
        for tid, lp in pos.items():
            lv[t, tid] = lp.logprob
    assert np.isfinite(lv).all()
    want = (np.exp(lh) * (lh - lv)).sum(axis=1)
    got = seq.metrics.kl_full[1:]
    assert np.max(np.abs(got - want)) <= 1e-6, (got, want)
    assert run.summary["kl_full_mean"] == pytest.approx(float(np.mean(want)), abs=1e-6)
    assert np.all(seq.metrics.kl_topk[1:] <= got + 1e-6)  # the top-k KL is a lower bound of the exact one


@pytest.mark.engine
def test_a_run_too_large_for_the_exact_kl_says_why_and_still_compares(tiny_bos, home, monkeypatch):
    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines import fullvocab
    from logprob_parity.inputs.spec import RunSpec

    monkeypatch.setattr(fullvocab, "MAX_BYTES", 1000)
    (run,) = compare(RunSpec(texts=(TEXT,), model=str(tiny_bos), dtypes=("float32",), device="cpu"), use_cache=False)
    assert run.meta.env.vllm_engine["kl_full"].startswith("not computed: ")
    assert "LPP_FULL_KL_MAX_BYTES" in run.meta.env.vllm_engine["kl_full"]
    assert run.summary["kl_full_mean"] is None and run.summary["max_abs_delta"] is not None
    assert np.isnan(run.sequences[0].metrics.kl_full).all()


def test_no_room_for_the_full_logprobs_is_said_not_crashed(monkeypatch):
    """A container's /dev/shm is often 64 MiB: a memory map past its end would kill the engine host,
    so a folder is only made where the bytes fit, and otherwise the run says why."""
    import shutil
    from collections import namedtuple

    from logprob_parity.engines import fullvocab

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    folder, why = fullvocab.folder_for(1000, 49152)  # 187.5 MiB of float32
    assert folder is None and "no room for 0.2 GiB" in why
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 40))
    folder, why = fullvocab.folder_for(1000, 49152)
    try:
        assert why is None and os.path.isdir(folder)
    finally:
        fullvocab.remove(folder)
    assert not os.path.exists(folder)


def test_folders_of_killed_processes_are_removed(tmp_path, monkeypatch):
    """A server killed mid-comparison leaves its folder behind; the next folder made cleans it up."""
    import subprocess
    import sys
    import tempfile

    from logprob_parity.engines import fullvocab

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=False
    ).stdout.strip()
    orphan = tmp_path / f"lpp-fullvocab-{dead}-abc"
    mine = tmp_path / f"lpp-fullvocab-{os.getpid()}-def"
    orphan.mkdir()
    mine.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(fullvocab.os, "access", lambda path, mode: path == str(tmp_path))
    made = fullvocab.new_folder(0)
    try:
        assert made is not None and made.startswith(str(tmp_path))
        assert not orphan.exists() and mine.exists()
    finally:
        fullvocab.remove(made)


def _v2_capture(target):
    """vLLM's v2 model runner path (the GPU default; the CPU build cannot run it without triton-cpu),
    with its PromptLogprobsWorker's inputs built by hand: request "a" (5 prompt tokens) in one step,
    "b" (7) split over two steps, and "c" decoding without prompt logprobs; vLLM's logits_fn called
    on chunks of 3 rows, captured into `target` (begin/end). Returns the prompts, each kept row's
    expected values (the log_softmax of its own position's logits: a misplaced row cannot pass; the
    last prompt position predicts a generated token and is not kept) and the chunk sizes seen."""
    from types import SimpleNamespace

    import torch

    from logprob_parity.engines import fullvocab

    vocab = 11
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 10, 1, 2], "c": [3, 4]}
    slot = {"a": 0, "b": 1, "c": 2}
    all_ids = torch.zeros((3, 16), dtype=torch.int64)
    for r, ids in prompts.items():
        all_ids[slot[r], : len(ids)] = torch.tensor(ids)
    prompt_lens = np.array([5, 7, 2])
    logits_of = {
        (r, p): torch.randn(vocab, generator=torch.Generator().manual_seed(100 * slot[r] + p))
        for r, ids in prompts.items()
        for p in range(len(ids) + 1)
    }

    def step(reqs):  # reqs: (request, first position, rows)
        hidden = torch.stack([logits_of[(r, p0 + k)] for r, p0, n in reqs for k in range(n)])
        starts = np.cumsum([0] + [n for _, _, n in reqs])
        batch = SimpleNamespace(
            req_ids=[r for r, _, _ in reqs],
            idx_mapping_np=np.array([slot[r] for r, _, _ in reqs]),
            num_computed_prefill_tokens_np=np.array([p0 for _, p0, _ in reqs]),
            query_start_loc_np=starts,
            prefill_len_np=prompt_lens[[slot[r] for r, _, _ in reqs]],
            num_tokens=int(starts[-1]),
        )
        return hidden, batch

    called = []

    class Worker:  # vLLM's PromptLogprobsWorker, as far as the capture reads it
        uses_prompt_logprobs = np.array([True, True, False])

        def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch, all_token_ids, num_computed_tokens, prompt_lens):
            for lo in range(0, input_batch.num_tokens, 3):
                called.append(logits_fn(hidden_states[lo : lo + 3]).shape[0])
            return {}

    worker = Worker()
    assert fullvocab._install_v2(worker) == "v2" and fullvocab._install_v2(worker) == "v2"  # wrapped once
    fullvocab.begin(target)
    for reqs in ([("a", 0, 5), ("b", 0, 4)], [("c", 2, 1), ("b", 4, 3)]):
        hidden, batch = step(reqs)
        worker.compute_prompt_logprobs(lambda h: h.clone(), hidden, batch, all_ids, None, prompt_lens)
    fullvocab.end(target, [prompts["b"], prompts["a"]])
    want = {
        r: np.stack([torch.log_softmax(logits_of[(r, p)].float(), dim=-1).numpy() for p in range(len(prompts[r]) - 1)])
        for r in ("a", "b")
    }
    return want, called


def test_the_v2_runner_capture_maps_chunked_rows_to_each_requests_positions(tmp_path):
    """Files: every kept row is its own position's log_softmax, each sequence in its own file. The
    real runner is checked on the GPU (tests/test_gpu.py)."""
    from logprob_parity.engines import fullvocab

    want, called = _v2_capture(str(tmp_path))
    assert fullvocab.problem(str(tmp_path)) is None and called == [3, 3, 3, 3, 1]
    for i, r in enumerate(["b", "a"]):
        np.testing.assert_array_equal(np.load(fullvocab.path_of(str(tmp_path), i)), want[r])


def test_with_a_sample_the_v2_capture_writes_only_the_sampled_rows_each_its_own_positions_log_softmax(tmp_path):
    """Engines in turn past the spool's bound: only every 2nd row from row 1 of each sequence is written
    (the log_softmax of those rows alone, bit for bit what every row's would be); the others stay
    holes of the sparse file, never copied."""
    from logprob_parity.engines import fullvocab

    fullvocab.set_sample(str(tmp_path), 2, 1)
    want, _ = _v2_capture(str(tmp_path))
    assert fullvocab.problem(str(tmp_path)) is None
    for i, r in enumerate(["b", "a"]):
        got = np.load(fullvocab.path_of(str(tmp_path), i))
        kept = fullvocab.sampled(len(got), (2, 1))
        assert kept.tolist() == [k % 2 == 1 for k in range(len(got))]
        np.testing.assert_array_equal(got[kept], want[r][kept])
        assert not got[~kept].any()


@pytest.mark.parametrize("rows", [10, None, 4])
def test_kept_tensors_are_views_of_one_tensor_a_batch_and_reach_the_reader_unchanged(rows):
    """Tensors: with the batch's row count given (10 = 4 + 6), the sequences' rows are views of one
    tensor, so the HF host opens one shared allocation a batch (on a GPU one CUDA IPC handle, not
    one a sequence); without it (None) each request gets a tensor of its own, and when it is too
    small for them all (4: request "a" fits, "b" does not) the one that does not fit gets its own. Either way the reader gets every row, in sequence order, bit
    for bit, and a released batch is gone."""
    from logprob_parity.engines import fullvocab

    token = f"test-{rows}"
    want, _ = _v2_capture({"tensors": token, "rows": rows})
    kept = fullvocab._KEPT[token]
    one = len({t.untyped_storage().data_ptr() for t in kept}) == 1
    assert one == (rows == 10), [t.untyped_storage().data_ptr() for t in kept]
    shared = fullvocab.share(token)
    assert "error" not in shared and len(shared["handles"]) == 2
    got = fullvocab.open_rows(shared)
    for t, r in zip(got, ["b", "a"]):
        np.testing.assert_array_equal(t.numpy(), want[r])
    if one:  # the reader opened the shared file once for both sequences
        assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    fullvocab.release(token)
    assert token not in fullvocab._KEPT and "error" in fullvocab.share(token)


def test_the_exact_kl_of_float32_rows_is_never_negative():
    """A float32 log_softmax sums to 1 only to about 1e-7: two rows that differ by such a shift are
    one distribution, and their KL must be 0, not the -1e-6 a sum over the raw rows gives."""
    import torch

    from logprob_parity.engines import fullvocab

    lh = torch.log_softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    shifted = lh.numpy() + np.float32(1e-6)  # probabilities summing to 1 + 1e-6
    raw = (np.exp(lh.double().numpy()) * (lh.double().numpy() - shifted.astype(np.float64))).sum(axis=1)
    assert (raw < -5e-7).all()  # what the sum over the raw rows would say
    kl = fullvocab.kl_rows(lh, shifted).numpy()
    assert np.abs(kl).max() < 1e-12, kl
    other = torch.log_softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(1)), dim=-1)
    assert (fullvocab.kl_rows(lh, other.numpy()).numpy() > 0.1).all()  # two different distributions stay apart


@pytest.mark.engine
def test_exact_kl_through_shared_tensors_equals_the_files_path(tiny_bos, home, monkeypatch):
    """The GPU transport (vLLM keeps its rows as tensors and shares them with the HF host, which sums
    the KL on the device) gives the very KL the files path gives, on the same engines and ids; on a
    CPU the tensors cross through shared-memory files, which is what this checks here."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.engines import fullvocab
    from logprob_parity.inputs.spec import RunSpec

    spec = RunSpec(texts=(TEXT, TEXT + " And once more, with feeling."), model=str(tiny_bos), dtypes=("float32",), device="cpu")
    got = {}
    for how in ("files", "tensors"):
        monkeypatch.setenv(fullvocab.TRANSPORT_ENV, how)
        (run,) = compare(spec, use_cache=False)
        assert run.meta.env.vllm_engine["kl_full"].startswith("exact, every position"), run.meta.env.vllm_engine["kl_full"]
        assert run.meta.env.vllm_engine["kl_transport"] == fullvocab.TRANSPORT_WORDS[how]
        got[how] = [s.metrics.kl_full[1:] for s in run.sequences]
        assert all(np.isfinite(k).all() for k in got[how])
    for a, b in zip(got["files"], got["tensors"]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-12)
