"""Rollout mode on the demo model with the real engines: vLLM samples (decode path), vLLM prefill and
HF rescore the same ids. float32 must agree three ways; bfloat16 must show a stored, displayed gap."""

import json
import shutil

import numpy as np
import pytest
import torch

from logprob_parity.analysis.request import Context
from logprob_parity.analysis.rollout import PROCESSED, RAW, rollout
from logprob_parity.engines import fullvocab
from logprob_parity.engines.host import HostClient
from logprob_parity.engines.records import LoadRequest
from logprob_parity.inputs.settings import EngineSettings
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.results.rollout import COLUMNS, PAIRS, Sampling
from logprob_parity.results.store import Store

pytestmark = pytest.mark.engine

PROMPTS = ("The capital of France is", "Write one line about the sea:")
# top-p below 1 and a temperature: vLLM's processed logprobs differ from its raw ones
SAMPLING = Sampling(samples=2, temperature=0.9, top_p=0.9, max_tokens=16, seed=7)


@pytest.fixture(scope="module")
def rolled(demo_model, tmp_path_factory):
    """Both dtypes rolled out once, with every id each engine was asked to score recorded (a spy
    that calls through to the real hosts)."""
    store = Store(tmp_path_factory.mktemp("rollout-home"))
    seen: dict[str, list] = {"prefill": [], "hf": [], "sampled": []}
    real_score, real_hf, real_sample = HostClient.score, HostClient.rollout_score, HostClient.sample

    def score(self, sequences, *a, **k):
        seen["prefill"].append([list(s) for s in sequences])
        return real_score(self, sequences, *a, **k)

    def rollout_score(self, sequences, starts, *a, **k):
        if k.get("chunk") is None:  # the trainer's pass, not a noise-floor one
            seen["hf"].append(([list(s) for s in sequences], list(starts)))
        return real_hf(self, sequences, starts, *a, **k)

    def sample(self, prompts, seeds, *a, **k):
        out = real_sample(self, prompts, seeds, *a, **k)
        seen["sampled"].append([list(p) + o["completion_ids"] for p, o in zip(prompts, out)])
        return out

    kept = tmp_path_factory.mktemp("vllm-full-rows")
    real_remove = fullvocab.remove

    def remove(folder):  # keep vLLM prefill's full rows (one folder per dtype, in order) before they go
        if folder:
            shutil.copytree(folder, kept / str(len(list(kept.iterdir()))))
        real_remove(folder)

    spec = RunSpec(texts=PROMPTS, model=str(demo_model), dtypes=("float32", "bfloat16"), device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostClient, "score", score)
        mp.setattr(HostClient, "rollout_score", rollout_score)
        mp.setattr(HostClient, "sample", sample)
        mp.setattr(fullvocab, "remove", remove)
        ros = rollout(spec, SAMPLING, Context.of(store=store), use_cache=False)
    seen["full_rows"] = {"float32": kept / "0", "bfloat16": kept / "1"}
    return {r.dtype: r for r in ros}, store, seen, spec


def test_float32_decode_prefill_and_hf_agree_three_ways(rolled):
    ros, _, _, _ = rolled
    ro = ros["float32"]
    assert len(ro.samples) == len(PROMPTS) * SAMPLING.samples
    for pair in ("decode_vs_hf", "decode_vs_prefill", "prefill_vs_hf"):
        s = ro.meta.summary[pair]
        assert s["n_tokens"] > 0 and s["max_abs_delta"] <= 1e-4, (pair, s["max_abs_delta"])
    # the trainer sees the renormalised rollout: processed − (HF at T − log kept mass) is rounding only
    for smp in ro.samples:
        lp = smp.logprob
        assert np.max(np.abs(lp["decode_processed"] - (lp["hf_tempered"] - lp["log_kept_mass"]))) <= 1e-4
        assert np.all(lp["log_kept_mass"] <= 1e-6) and np.any(lp["log_kept_mass"] < -1e-3)


def test_bfloat16_gap_is_nonzero_stored_and_displayed(rolled):
    from logprob_parity.present.rollout_view import completion_html

    ros, store, _, _ = rolled
    ro = ros["bfloat16"]
    s = ro.meta.summary["decode_vs_hf"]
    assert s["mean_abs_delta"] > 1e-4 and s["max_abs_delta"] > 1e-3, s
    back = store.load_rollout(ro.rollout_id)
    assert back.meta.summary == json.loads(json.dumps(ro.meta.summary))
    for a, b in zip(ro.samples, back.samples):
        assert a.completion_token_ids == b.completion_token_ids
        for c in COLUMNS:
            assert np.array_equal(a.logprob[c], b.logprob[c]), c
    page = completion_html(back, 0, "decode_vs_hf")
    shown = [float(x) for x in __import__("re").findall(r'data-value="([^"]+)"', page)]
    assert len(shown) == len(back.samples[0].completion_token_ids)
    assert np.allclose(shown, np.abs(back.samples[0].delta("decode_vs_hf")), rtol=0, atol=0) and max(shown) > 0


def test_the_three_scorings_score_identical_ids(rolled):
    ros, _, seen, _ = rolled
    for ro in ros.values():
        full = [list(s.prompt_token_ids) + list(s.completion_token_ids) for s in ro.samples]
        assert full in seen["sampled"], "vLLM decode sampled these completions"
        assert full in seen["prefill"], "vLLM prefill rescored exactly these ids"
        assert (full, [len(s.prompt_token_ids) for s in ro.samples]) in seen["hf"], "HF rescored exactly these ids"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_column_equals_an_independent_teacher_forced_pass(rolled, demo_model, dtype):
    from transformers import AutoModelForCausalLM

    ros, _, _, _ = rolled
    model = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=getattr(torch, dtype)).eval()
    for smp in ros[dtype].samples:
        ids = list(smp.prompt_token_ids) + list(smp.completion_token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double().numpy()
        mine = lp[len(smp.prompt_token_ids) - 1 :]
        assert np.max(np.abs(mine - smp.logprob["hf"])) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_vs_hf_exact_kl_equals_numpy_over_both_full_distributions(rolled, demo_model, dtype):
    """The rollout's exact KL(HF || vLLM prefill) at each completion token, against numpy over
    vLLM's own full rows (kept from the run) and HF's, recomputed here with transformers; and
    llama.cpp's statistics in the summary, stored and reloaded, with the JSON per position."""
    from transformers import AutoModelForCausalLM

    from logprob_parity.results.metrics import exact_kl_stats

    ros, store, seen, _ = rolled
    ro = ros[dtype]
    assert ro.meta.env.vllm_engine["kl_full"] == "exact, every completion token of prefill_vs_hf"
    model = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=getattr(torch, dtype)).eval()
    for k, smp in enumerate(ro.samples):
        ids = list(smp.prompt_token_ids) + list(smp.completion_token_ids)
        n0 = len(smp.prompt_token_ids)
        with torch.inference_mode():
            lh = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1).double().numpy()[n0 - 1 :]
        lv = np.load(fullvocab.path_of(str(seen["full_rows"][dtype]), k)).astype(np.float64)[n0 - 1 :]
        want = (np.exp(lh) * (lh - lv)).sum(axis=1)
        got = smp.exact["kl_full"]
        # bfloat16: HF's logits recomputed in this process move by up to 1e-5 (the test above), the KL with them
        assert np.max(np.abs(got - want)) <= (1e-6 if dtype == "float32" else 1e-5), (k, got, want)
        assert np.all(got >= -1e-12)
        np.testing.assert_array_equal(smp.exact["same_top"], (lh.argmax(1) == lv.argmax(1)).astype(float))
    s = ro.meta.summary["prefill_vs_hf"]
    allkl = np.concatenate([x.exact["kl_full"] for x in ro.samples])
    assert s["kl_full_mean"] == pytest.approx(float(allkl.mean())) and s["kl_full_p99_9"] is not None
    assert s["same_top_p"] == pytest.approx(float(np.concatenate([x.exact["same_top"] for x in ro.samples]).mean()))
    assert ro.meta.summary["decode_vs_hf"].get("kl_full_mean") is None  # a decode has no full distribution
    if dtype == "float32":
        assert s["kl_full_max"] < 1e-6 and s["same_top_p"] == 1.0
    else:
        assert s["kl_full_mean"] > 1e-5
    back = store.load_rollout(ro.rollout_id)
    np.testing.assert_array_equal(back.samples[0].exact["kl_full"], ro.samples[0].exact["kl_full"])
    pos = back.to_json_dict()["samples"][0]["positions"][0]["prefill_vs_hf"]
    assert pos["kl_full"] == pytest.approx(float(ro.samples[0].exact["kl_full"][0]), abs=0) and pos["same_top"] in (0.0, 1.0)
    assert exact_kl_stats(allkl)["kl_full_mean"] == s["kl_full_mean"]


def test_the_same_seed_reproduces_tokens_and_decode_logprobs(rolled):
    ros, store, _, spec = rolled
    again = {r.dtype: r for r in rollout(spec, SAMPLING, Context.of(store=store), use_cache=False)}
    for d, ro in ros.items():
        assert not again[d].from_store
        for a, b in zip(ro.samples, again[d].samples):
            assert a.seed == b.seed and a.completion_token_ids == b.completion_token_ids
            assert np.array_equal(a.logprob["decode_raw"], b.logprob["decode_raw"])
            assert np.array_equal(a.logprob["decode_processed"], b.logprob["decode_processed"])


def test_the_rollout_id_holds_the_sampling_settings_and_seed(rolled):
    from logprob_parity.analysis.request import prepare
    from logprob_parity.analysis.rollout import rollout_id_for, with_rollout_defaults

    ros, store, _, spec = rolled
    p = prepare(with_rollout_defaults(spec), Context.of(store=store))
    base = rollout_id_for(p, SAMPLING, "float32", 2)
    assert base == ros["float32"].rollout_id
    import dataclasses

    for change in ({"seed": 8}, {"temperature": 1.0}, {"top_p": 1.0}, {"top_k": 5}, {"samples": 3}, {"max_tokens": 15}):
        assert rollout_id_for(p, dataclasses.replace(SAMPLING, **change), "float32", 2) != base, change
    assert store.has_rollout(base) and store.list_rollouts()["rollout_id"].tolist().count(base) == 1


def test_noise_floors_are_measured_and_named_by_the_one_definition(rolled):
    from logprob_parity.results.rollout import hf_floor, hf_floor_words

    ros, _, _, _ = rolled
    meta = ros["float32"].meta
    floors = meta.floors
    assert set(floors) == {"decode_batch", "micro_batch", "padding_side", "packed", "chunked_kv", "envelope", "hf_incremental"}
    defined = {k: f for k, f in floors.items() if f.get("in_floor")}
    # the envelope (the most HF moved each token under any variation) is where the tail is read, not the floor
    assert floors["envelope"]["tail"] is not None and not floors["envelope"]["in_floor"]
    assert set(defined) == {"micro_batch", "padding_side", "packed", "chunked_kv"}  # logprob_parity.analysis.floors
    # the trainer side's floor is the largest of the definition's variations, and the verdict names it
    assert hf_floor(meta) == max(f["mean"] for f in defined.values())
    assert hf_floor_words(meta).startswith("HF moves") and hf_floor_words(meta) in " ".join(meta.verdict["reasons"])
    assert floors["decode_batch"]["of"] == 2 and floors["decode_batch"]["same_tokens"] == 2  # float32 on a CPU
    for f in floors.values():
        assert f["n"] > 0 and f["mean"] is not None and f["max"] <= 1e-4 and f["what"]


def test_processed_equals_raw_at_temperature_one_without_a_cut(demo_model):
    """Why a rollout at temperature 1 with no top-k/top-p skips the processed pass: vLLM's two modes
    give the same numbers there (measured, not assumed)."""
    from logprob_parity.engines.pool import POOL

    ids = [[1, 504, 3575, 282, 4649, 314], [1, 18637, 1608, 253, 655, 30]]
    req = LoadRequest("vllm", str(demo_model), "float32", "cpu", EngineSettings(), 256)
    with POOL.lease([req]) as lease:
        out = lease.host(req).sample(ids, [3, 4], Sampling(temperature=1.0, max_tokens=8).to_dict(), (RAW, PROCESSED))
    for o in out:
        assert o["tokens_by_mode"][RAW] == o["tokens_by_mode"][PROCESSED]
        assert np.array_equal(o["logprobs"][RAW], o["logprobs"][PROCESSED])


def test_rollout_cli_writes_the_documented_json(rolled, demo_model, tmp_path, monkeypatch, capsys):
    from logprob_parity.cli import main

    monkeypatch.setenv("LOGPROB_PARITY_HOME", str(tmp_path))
    out = tmp_path / "ro.json"
    rc = main(
        [
            "rollout",
            "--model",
            str(demo_model),
            "--prompt",
            PROMPTS[0],
            "--dtype",
            "float32",
            "--samples",
            "2",
            "--max-tokens",
            "6",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "decode_vs_hf" in text and "noise floors" in text and "Rollout float32" in text
    data = json.loads(out.read_text())
    assert data["sampling"] == {
        "samples": 2,
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 6,
        "seed": 3,
        "ignore_eos": False,
    }
    assert set(data["summary"]) == set(PAIRS)
    assert data["settings"]["enforce_eager"] is True  # a CPU has no CUDA graphs
    for smp in data["samples"]:
        assert smp["prompt_token_ids"] and len(smp["completion_token_ids"]) == len(smp["positions"]) >= 1
        assert set(smp["metrics"]) == set(PAIRS)
        pos = smp["positions"][0]
        assert set(pos["logprob"]) == {"decode_raw", "decode_processed", "prefill", "hf"}
        assert pos["delta"]["decode_vs_hf"] == pytest.approx(pos["logprob"]["decode_raw"] - pos["logprob"]["hf"], abs=0)
    rc = main(["report", data["rollout_id"], "-o", str(tmp_path / "r.html")])
    assert rc == 0 and "Three-way comparison" in (tmp_path / "r.html").read_text()
    rc = main(["report", data["rollout_id"][:10], "-o", str(tmp_path / "r.parquet")])
    import pandas as pd

    assert rc == 0 and set(COLUMNS) <= set(pd.read_parquet(tmp_path / "r.parquet").columns)
