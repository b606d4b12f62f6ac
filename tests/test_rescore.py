"""Rescoring logged rollouts: bad files named by record and field, nothing stored; with the real
engines, `rollout --json` output round-trips and a perturbed token ranks first."""

from __future__ import annotations

import json

import numpy as np
import pytest

from logprob_parity.cli import main
from logprob_parity.errors import UserError
from logprob_parity.inputs.rollout_logs import parse_mapping, read_logged
from logprob_parity.inputs.tokens import load_tokenizer
from logprob_parity.results.store import Store


@pytest.fixture(scope="module")
def tok(tiny_bos):
    return load_tokenizer(str(tiny_bos))


def _jsonl(*records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


GOOD = {"prompt_token_ids": [0, 40, 41], "completion_token_ids": [42, 43], "logprobs": [-1.5, -0.25], "id": "a"}


def test_good_records_read_with_their_fields_and_mapping(tok):
    renamed = {"prompts": [0, 40, 41], "responses": [42, 43], "rollout_log_probs": [-1.5, -0.25], "temperature": 0.7}
    plain = read_logged(_jsonl(GOOD), "r.jsonl", {}, tok, "auto", 512)
    s = read_logged(
        _jsonl(renamed, renamed),
        "r.jsonl",
        parse_mapping("prompt_token_ids=prompts,completion_token_ids=responses,logprobs=rollout_log_probs"),
        tok,
        "auto",
        512,
    )
    assert len(s.sequences) == 2 and s.n_tokens == 4 and plain.sequences[0].id == "a"
    assert s.sequences[1].temperature == 0.7 and s.sequences[0].completion_token_ids == plain.sequences[0].completion_token_ids
    whole = read_logged(_jsonl({"token_ids": [0, 40, 41, 42, 43], "logprobs": [-1.5, -0.25]}), "w.jsonl", {}, tok, "auto", 512)
    assert whole.sequences[0].prompt_token_ids == (0, 40, 41) and whole.sequences[0].completion_token_ids == (42, 43)
    text = read_logged(
        _jsonl({"prompt": "Shall I compare", "completion_token_ids": [42], "logprobs": [-1.0]}), "t.jsonl", {}, tok, "auto", 512
    )
    assert text.sequences[0].prompt_token_ids[0] == tok.bos_token_id


@pytest.mark.parametrize(
    "bad, words",
    [
        ({**GOOD, "logprobs": [-1.5]}, "record 1 (id 'a'): logprobs has 1 values but completion_token_ids has 2 ids"),
        ({**GOOD, "completion_token_ids": [42, 9999]}, "completion_token_ids[1] = 9999 is outside this model's vocabulary"),
        ({**GOOD, "logprobs": [-1.5, float("nan")]}, "logprobs[1] is NaN"),
        ({**GOOD, "logprobs": [0.4, -0.2]}, "logprobs[0] is 0.4, above 0"),
        ({**GOOD, "prompt": "Shall I compare thee"}, "not what this model's tokenizer makes of its prompt text"),
        ({"prompt_token_ids": [0, 4], "logprobs": [-1.0]}, "has no completion_token_ids or token_ids"),
        ({**GOOD, "completion_token_ids": "42 43"}, "completion_token_ids must be a list of token ids"),
    ],
)
def test_each_bad_record_is_named_with_its_field(tok, bad, words):
    with pytest.raises(UserError) as err:
        read_logged(_jsonl(GOOD, bad), "bad.jsonl", {}, tok, "auto", 512)
    assert "record 2" in str(err.value) and words.replace("record 1", "record 2") in str(err.value)


def test_a_bad_file_stores_nothing_and_exits_2(tiny_bos, home, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(_jsonl(GOOD, {**GOOD, "logprobs": [-1.0, float("nan")]}))
    rc = main(["rescore", "--rollouts", str(path), "--model", str(tiny_bos), "--device", "cpu", "--quiet"])
    assert rc == 2 and "record 2" in capsys.readouterr().err
    assert Store(home).list_rollouts().empty
    assert main(["rescore", "--rollouts", str(path), "--map", "logprobs", "--model", str(tiny_bos)]) == 2
    assert main(["rescore", "--rollouts", str(tmp_path / "missing.jsonl"), "--model", str(tiny_bos)]) == 2


@pytest.mark.engine
def test_rollout_json_round_trips_through_rescore_and_a_perturbed_token_ranks_first(demo_model, home, tmp_path, capsys):
    """A real rollout's --json rescored as logged rollouts: the decode column is the logged one, HF
    rescores to what it gave in the rollout (1e-6); one logged logprob moved by 2 nats is the worst token."""
    out = tmp_path / "ro.json"
    assert (
        main(
            [
                "rollout",
                "--model",
                str(demo_model),
                "--prompt",
                "The capital of France is",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--samples",
                "2",
                "--max-tokens",
                "12",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    back = tmp_path / "back.json"
    capsys.readouterr()
    assert (
        main(
            [
                "rescore",
                "--rollouts",
                str(out),
                "--model",
                str(demo_model),
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--json",
                str(back),
                "--quiet",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "(computed)" in said and "(from the store)" not in said  # computed now, though read back from its file
    res = json.loads(back.read_text())
    assert res["sampling"]["source"] == "logged" and len(res["samples"]) == len(data["samples"]) == 2
    for a, b in zip(data["samples"], res["samples"]):
        assert a["completion_token_ids"] == b["completion_token_ids"]
        for pa, pb in zip(a["positions"], b["positions"]):
            assert pb["logprob"]["decode_raw"] == pa["logprob"]["decode_raw"]
            assert abs(pb["logprob"]["hf"] - pa["logprob"]["hf"]) <= 1e-6
    # one token's logged logprob moved by 2 nats: the largest importance-ratio break
    s = data["samples"][1]
    lines = [
        {
            "prompt_token_ids": x["prompt_token_ids"],
            "completion_token_ids": x["completion_token_ids"],
            "logprobs": [p["logprob"]["decode_raw"] for p in x["positions"]],
            "id": f"s{i}",
        }
        for i, x in enumerate(data["samples"])
    ]
    lines[1]["logprobs"][5] -= 2.0
    path = tmp_path / "perturbed.jsonl"
    path.write_bytes(_jsonl(*lines))
    from logprob_parity.analysis.request import Context
    from logprob_parity.analysis.rescore import rescore
    from logprob_parity.inputs.spec import RunSpec

    (ro,) = rescore(
        path.read_bytes(),
        path.name,
        RunSpec(texts=("x",), model=str(demo_model), dtypes=("float32",), device="cpu"),
        Context.of(store=Store(home)),
    )
    worst = ro.worst_tokens("decode_vs_hf", 5)
    assert (worst.loc[0, "sample"], worst.loc[0, "position"]) == (1, 5) and worst.loc[0, "delta"] < -1.9
    assert ro.worst_sequences("decode_vs_hf").loc[0, "sample"] == 1
    assert np.isfinite(ro.samples[0].exact["kl_full"]).all() and s["completion_token_ids"] == list(
        ro.samples[1].completion_token_ids
    )
    assert Store(home).has_rollout(ro.rollout_id)


@pytest.mark.engine
def test_a_killed_rescore_resumes_without_recomputing_its_stored_batches(tiny_bos, home, tmp_path):
    """`rescore` killed with SIGKILL after some batches were stored: the same command run again says
    how many batches came from the store, computes the rest, leaves no parts behind, and gives the
    values an uninterrupted rescore gives, sequence by sequence."""
    import subprocess
    import sys

    from conftest import cli_env, kill_after_parts

    rng = np.random.default_rng(0)
    records = [
        {
            "prompt_token_ids": [0, *rng.integers(40, 500, 6).tolist()],
            "completion_token_ids": rng.integers(40, 500, 10).tolist(),
            "logprobs": (-rng.random(10) * 3).tolist(),
            "id": f"r{i}",
        }
        for i in range(60)
    ]
    path = tmp_path / "logged.jsonl"
    path.write_bytes(_jsonl(*records))
    env = dict(cli_env(home), LPP_BATCH_TOKENS="48")  # three sequences a batch: twenty batches
    cmd = [
        sys.executable,
        "-m",
        "logprob_parity.cli",
        "rescore",
        "--rollouts",
        str(path),
        "--model",
        str(tiny_bos),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    stored = kill_after_parts(cmd, env, home, 3)
    partial = home / "partial"
    assert Store(home).list_rollouts().empty  # nothing half-stored
    again = subprocess.run(
        cmd + ["--json", str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{stored} of 20 batches came from the store" in again.stderr, again.stderr[-3000:]
    assert not any(partial.glob("*/part-*.arrow"))
    assert not any((partial / "logged").glob("*.arrow"))  # the killed process's staged file went with the next run
    clean = subprocess.run(
        cmd + ["--no-cache", "--json", str(tmp_path / "clean.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert clean.returncode == 0, clean.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("out.json", "clean.json"))
    assert a["rollout_id"] == b["rollout_id"] and len(a["samples"]) == len(b["samples"]) == 60
    for x, y in zip(a["samples"], b["samples"]):
        assert x["completion_token_ids"] == y["completion_token_ids"]
        assert [p["logprob"] for p in x["positions"]] == [p["logprob"] for p in y["positions"]]
    assert a["summary"] == b["summary"]


def test_a_staged_file_reads_back_the_sequences_it_checked_and_a_bad_one_leaves_no_staged_file(tok, tmp_path):
    """The rescore's staged file (records checked once, kept on disk, read back a batch at a time) gives the
    sequences and digest the in-memory reader gives, from a path or from an upload's bytes."""
    from logprob_parity.inputs.rollout_logs import STAGED_ROWS, stage_logged

    rng = np.random.default_rng(5)
    records = [
        {
            "prompt_token_ids": [0, *rng.integers(40, 500, int(rng.integers(1, 6))).tolist()],
            "completion_token_ids": rng.integers(40, 500, 3).tolist(),
            "logprobs": (-rng.random(3)).tolist(),
            "temperature": [1.0, 0.7][i % 2],
            "step": i // 10,
            **({"id": f"r{i}"} if i % 3 else {}),
        }
        for i in range(STAGED_ROWS + 5)
    ]  # two record batches in the staged file
    path = tmp_path / "many.jsonl"
    path.write_bytes(_jsonl(*records))
    whole = read_logged(path, path.name, {}, tok, "auto", 512)
    idx = [STAGED_ROWS + 4, 0, 7, STAGED_ROWS - 1, STAGED_ROWS]
    for source in (path, path.read_bytes()):
        staged = tmp_path / "staged.arrow"
        got = stage_logged(source, path.name, {}, tok, "auto", 512, staged)
        assert got.digest == whole.digest and len(got) == len(records) and got.n_tokens == whole.n_tokens
        assert got.read(idx) == [whole.sequences[i] for i in idx]
        assert got.temperature[1] == 0.7 and got.completion_len.tolist() == [3] * len(records)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_jsonl(*records[:5], {**GOOD, "logprobs": [-1.0, float("nan")]}))
    with pytest.raises(UserError, match="record 6"):
        stage_logged(bad, bad.name, {}, tok, "auto", 512, tmp_path / "bad.arrow")
    assert not (tmp_path / "bad.arrow").exists()


def _random_samples(rng, n):
    from logprob_parity.results.rollout import Sample

    out = []
    for i in range(n):
        k = int(rng.integers(1, 9))
        hf = -rng.exponential(1.0, k)
        out.append(
            Sample(
                prompt_index=i,
                seed=-1,
                prompt_token_ids=tuple(rng.integers(0, 500, 3).tolist()),
                completion_token_ids=tuple(rng.integers(0, 500, k).tolist()),
                pieces=tuple(["שלום", "猫", "🙂", " a", "", "\n", "<b>", "x"][:k]),
                finish_reason=f"logged record {i + 1}",
                logprob={
                    "decode_raw": hf + rng.standard_normal(k) * 0.1,
                    "decode_processed": hf.copy(),
                    "prefill": hf * 1.001,
                    "hf": hf,
                    "hf_tempered": hf * 1.1,
                    "log_kept_mass": np.zeros(k),
                },
                exact={"kl_full": rng.random(k) * 1e-3, "same_top": np.ones(k)},
                prompt_text=f"prompt {i} «ok»",
            )
        )
    return out


def test_a_stored_rescore_reads_its_samples_from_its_file_and_gives_what_they_held(home, monkeypatch):
    """A rescore is stored from tables of its samples (written in sequence order, as `finish` writes
    them, in row groups of 7 rows that cut samples) and read back lazily: every sample, the worst
    lists, the histograms' rows, the frame and the --json are those of the same samples held in
    memory; nothing per sample sits in the metadata or the index row."""
    import dataclasses
    import io
    import sqlite3

    from logprob_parity.present.rollout_view import token_frame

    monkeypatch.setattr("logprob_parity.results.store.ROW_GROUP", 7)
    from logprob_parity.results.records import RunEnv
    from logprob_parity.results.rollout import Rollout, RolloutMeta, StoredSamples, sample_table

    rng = np.random.default_rng(11)
    samples = _random_samples(rng, 300)
    meta = RolloutMeta(
        rollout_id="ab" * 16,
        created="",
        created_ts=0.0,
        model="m",
        model_path="m",
        revision=None,
        model_identity={},
        dtype="float32",
        device="cpu",
        bos="auto",
        settings={},
        sampling={"source": "logged", "file": "x.jsonl", "records": len(samples)},
        prompts=(),
        processed="",
        env=RunEnv(device="cpu", torch="t", transformers="t", vllm="v", vllm_dist="v", hf_engine={}, vllm_engine={}),
        timing={},
        summary={},
        floors={},
    )
    store = Store(home)
    store.write_rollout(
        meta, (sample_table(samples[lo : lo + 70], range(lo, min(lo + 70, 300))) for lo in range(0, 300, 70)), 300
    )
    lazy = store.load_rollout(meta.rollout_id)
    held = Rollout(meta=meta, samples=tuple(samples))
    assert isinstance(lazy.samples, StoredSamples) and len(lazy.samples) == 300
    for i in (0, 69, 70, 299, 150):
        a, b = lazy.samples[i], samples[i]
        assert (a.prompt_index, a.prompt_token_ids, a.completion_token_ids, a.pieces, a.finish_reason, a.prompt_text) == (
            b.prompt_index,
            b.prompt_token_ids,
            b.completion_token_ids,
            b.pieces,
            b.finish_reason,
            b.prompt_text,
        )
        for c in b.logprob:
            assert np.array_equal(a.logprob[c], b.logprob[c])
        assert lazy.prompt_of(i) == b.prompt_text
    for pair in ("decode_vs_hf", "prefill_vs_hf"):
        assert lazy.worst_tokens(pair, 15).equals(held.worst_tokens(pair, 15))
        assert lazy.worst_sequences(pair, 15).equals(held.worst_sequences(pair, 15))
        assert token_frame(lazy, pair, pieces=False).equals(token_frame(held, pair, pieces=False))
    assert lazy.to_frame().equals(held.to_frame())
    one, two = io.StringIO(), io.StringIO()
    lazy.write_json(one)
    dataclasses.replace(held).write_json(two)
    assert one.getvalue() == two.getvalue()
    with sqlite3.connect(home / "index.sqlite") as db:
        (row,) = db.execute("SELECT meta FROM rollouts").fetchone()
    assert "prompt 299" not in row and json.loads(row)["first_text"].startswith("logged: 300 sequences")


@pytest.mark.engine
def test_a_rescore_cut_in_windows_and_sampling_groups_stores_every_record_in_file_order(tiny_bos, home, tmp_path, monkeypatch):
    """With windows of 7 sequences and records of two temperatures (so batches leave the file's
    order), the real engines' rescore is stored in record order: each sample holds its record's ids,
    logged logprobs and prompt, and the summary is the whole-set metrics of what was stored."""
    import math

    import logprob_parity.analysis.rescore as rs
    from logprob_parity.analysis.request import Context
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.inputs.tokens import load_tokenizer
    from logprob_parity.results.offpolicy import mismatch_metrics
    from logprob_parity.results.rollout import PAIRS, exact_stats

    monkeypatch.setattr(rs, "WINDOW_SEQUENCES", 7)
    monkeypatch.setenv("LPP_BATCH_TOKENS", "40")
    rng = np.random.default_rng(2)
    records = [
        {
            "prompt_token_ids": [0, *rng.integers(40, 500, int(rng.integers(2, 6))).tolist()],
            "completion_token_ids": rng.integers(40, 500, int(rng.integers(3, 9))).tolist(),
            "id": f"r{i}",
            "temperature": (1.0, 0.6)[int(rng.integers(0, 2))],
        }
        for i in range(23)
    ]
    for r in records:
        r["logprobs"] = (-rng.random(len(r["completion_token_ids"])) * 3).tolist()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(_jsonl(*records))
    (ro,) = rs.rescore(
        path,
        path.name,
        RunSpec(texts=("x",), model=str(tiny_bos), dtypes=("float32",), device="cpu"),
        Context.of(store=Store(home)),
    )
    assert ro.meta.timing["batches"] >= 8 and len(ro.samples) == 23 and ro.meta.sampling["varies"]
    tok = load_tokenizer(str(tiny_bos))
    for i, r in enumerate(records):
        s = ro.samples[i]
        assert list(s.completion_token_ids) == r["completion_token_ids"] and list(s.prompt_token_ids) == r["prompt_token_ids"]
        assert s.logprob["decode_raw"].tolist() == r["logprobs"] and s.finish_reason == f"logged record {i + 1}, id r{i}"
        assert ro.prompt_of(i) == tok.decode(r["prompt_token_ids"]) and np.isfinite(s.logprob["hf"]).all()
    held = [ro.samples[i] for i in range(23)]
    for pair, (a, b, _) in PAIRS.items():
        want = mismatch_metrics([s.logprob[a] for s in held], [s.logprob[b] for s in held])
        if pair == "prefill_vs_hf":
            want.update(exact_stats(held))
        for k, v in want.items():
            got = ro.meta.summary[pair][k]
            assert got == v or (isinstance(v, float) and math.isclose(got, v, rel_tol=1e-12, abs_tol=1e-13)), (pair, k, got, v)
    assert not any((home / "partial").glob("*/part-*.arrow")) and not any((home / "partial").glob("logged/*.arrow"))
