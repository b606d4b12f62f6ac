"""Rescoring logged rollouts: bad files named by record and field, nothing stored; with the real
engines, `rollout --json` output round-trips and a perturbed token ranks first."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.cli import main
from core.errors import UserError
from core.inputs.rollout_logs import parse_mapping, read_logged
from core.inputs.tokens import load_tokenizer
from core.results.store import Store


@pytest.fixture(scope="module")
def tok(tiny_bos):
    return load_tokenizer(str(tiny_bos))


def _jsonl(*records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


GOOD = {"prompt_token_ids": [0, 40, 41], "completion_token_ids": [42, 43], "logprobs": [-1.5, -0.25], "id": "a"}


def test_good_records_read_with_their_fields_and_mapping(tok):
    renamed = {"prompts": [0, 40, 41], "responses": [42, 43], "rollout_log_probs": [-1.5, -0.25], "temperature": 0.7}
    plain = read_logged(_jsonl(GOOD), "r.jsonl", {}, tok, "auto", 512)
    s = read_logged(_jsonl(renamed, renamed), "r.jsonl", parse_mapping("prompt_token_ids=prompts,completion_token_ids=responses,"
                                                                        "logprobs=rollout_log_probs"), tok, "auto", 512)
    assert len(s.sequences) == 2 and s.n_tokens == 4 and plain.sequences[0].id == "a"
    assert s.sequences[1].temperature == 0.7 and s.sequences[0].completion_token_ids == plain.sequences[0].completion_token_ids
    whole = read_logged(_jsonl({"token_ids": [0, 40, 41, 42, 43], "logprobs": [-1.5, -0.25]}), "w.jsonl", {}, tok, "auto", 512)
    assert whole.sequences[0].prompt_token_ids == (0, 40, 41) and whole.sequences[0].completion_token_ids == (42, 43)
    text = read_logged(_jsonl({"prompt": "Shall I compare", "completion_token_ids": [42], "logprobs": [-1.0]}), "t.jsonl", {},
                       tok, "auto", 512)
    assert text.sequences[0].prompt_token_ids[0] == tok.bos_token_id


@pytest.mark.parametrize("bad, words", [
    ({**GOOD, "logprobs": [-1.5]}, "record 1 (id 'a'): logprobs has 1 values but completion_token_ids has 2 ids"),
    ({**GOOD, "completion_token_ids": [42, 9999]}, "completion_token_ids[1] = 9999 is outside this model's vocabulary"),
    ({**GOOD, "logprobs": [-1.5, float("nan")]}, "logprobs[1] is NaN"),
    ({**GOOD, "logprobs": [0.4, -0.2]}, "logprobs[0] is 0.4, above 0"),
    ({**GOOD, "prompt": "Shall I compare thee"}, "not what this model's tokenizer makes of its prompt text"),
    ({"prompt_token_ids": [0, 4], "logprobs": [-1.0]}, "has no completion_token_ids or token_ids"),
    ({**GOOD, "completion_token_ids": "42 43"}, "completion_token_ids must be a list of token ids"),
])
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
def test_rollout_json_round_trips_through_rescore_and_a_perturbed_token_ranks_first(demo_model, home, tmp_path):
    """A real rollout's --json rescored as logged rollouts: the decode column is the logged one, HF
    rescores to what it gave in the rollout (1e-6); one logged logprob moved by 2 nats is the worst token."""
    out = tmp_path / "ro.json"
    assert main(["rollout", "--model", str(demo_model), "--prompt", "The capital of France is", "--dtype", "float32",
                 "--device", "cpu", "--samples", "2", "--max-tokens", "12", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    back = tmp_path / "back.json"
    assert main(["rescore", "--rollouts", str(out), "--model", str(demo_model), "--dtype", "float32", "--device", "cpu",
                 "--json", str(back), "--quiet"]) == 0
    res = json.loads(back.read_text())
    assert res["sampling"]["source"] == "logged" and len(res["samples"]) == len(data["samples"]) == 2
    for a, b in zip(data["samples"], res["samples"]):
        assert a["completion_token_ids"] == b["completion_token_ids"]
        for pa, pb in zip(a["positions"], b["positions"]):
            assert pb["logprob"]["decode_raw"] == pa["logprob"]["decode_raw"]
            assert abs(pb["logprob"]["hf"] - pa["logprob"]["hf"]) <= 1e-6
    # one token's logged logprob moved by 2 nats: the largest importance-ratio break
    s = data["samples"][1]
    lines = [{"prompt_token_ids": x["prompt_token_ids"], "completion_token_ids": x["completion_token_ids"],
              "logprobs": [p["logprob"]["decode_raw"] for p in x["positions"]], "id": f"s{i}"} for i, x in enumerate(data["samples"])]
    lines[1]["logprobs"][5] -= 2.0
    path = tmp_path / "perturbed.jsonl"
    path.write_bytes(_jsonl(*lines))
    from core.analysis.request import Context
    from core.analysis.rescore import rescore
    from core.inputs.spec import RunSpec

    (ro,) = rescore(path.read_bytes(), path.name, RunSpec(texts=("x",), model=str(demo_model), dtypes=("float32",), device="cpu"),
                    Context.of(store=Store(home)))
    worst = ro.worst_tokens("decode_vs_hf", 5)
    assert (worst.loc[0, "sample"], worst.loc[0, "position"]) == (1, 5) and worst.loc[0, "delta"] < -1.9
    assert ro.worst_sequences("decode_vs_hf").loc[0, "sample"] == 1
    assert np.isfinite(ro.samples[0].exact["kl_full"]).all() and s["completion_token_ids"] == list(ro.samples[1].completion_token_ids)
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
    records = [{"prompt_token_ids": [0, *rng.integers(40, 500, 6).tolist()], "completion_token_ids": rng.integers(40, 500, 10).tolist(),
                "logprobs": (-rng.random(10) * 3).tolist(), "id": f"r{i}"} for i in range(60)]
    path = tmp_path / "logged.jsonl"
    path.write_bytes(_jsonl(*records))
    env = dict(cli_env(home), LPP_BATCH_TOKENS="48")  # three sequences a batch: twenty batches
    cmd = [sys.executable, "-m", "core.cli", "rescore", "--rollouts", str(path), "--model", str(tiny_bos), "--dtype", "float32",
           "--device", "cpu"]
    stored = kill_after_parts(cmd, env, home, 3)
    partial = home / "partial"
    assert Store(home).list_rollouts().empty  # nothing half-stored
    again = subprocess.run(cmd + ["--json", str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{stored} of 20 batches came from the store" in again.stderr, again.stderr[-3000:]
    assert not any(partial.glob("*/part-*.arrow"))
    clean = subprocess.run(cmd + ["--no-cache", "--json", str(tmp_path / "clean.json")], env=env, capture_output=True, text=True,
                           timeout=600)
    assert clean.returncode == 0, clean.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("out.json", "clean.json"))
    assert a["rollout_id"] == b["rollout_id"] and len(a["samples"]) == len(b["samples"]) == 60
    for x, y in zip(a["samples"], b["samples"]):
        assert x["completion_token_ids"] == y["completion_token_ids"]
        assert [p["logprob"] for p in x["positions"]] == [p["logprob"] for p in y["positions"]]
    assert a["summary"] == b["summary"]
