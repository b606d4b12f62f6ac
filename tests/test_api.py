"""The Python API (`import logprob_parity as lp`): the calls a notebook or a training loop needs."""

from __future__ import annotations

import pytest
from test_check import _stored

import logprob_parity as lp


def test_load_check_and_diff_work_on_stored_ids(home):
    _stored(home, "a91a0001")
    _stored(home, "a91a0002", scale=2.0)
    run = lp.load("a91a0001")
    assert run.run_id == "a91a0001" and len(run.to_pandas()) == sum(len(s.token_ids) for s in run.sequences)
    gate = lp.check("a91a0002", baseline="a91a0001", max_worsening=1.5)
    assert not gate.passed and gate.exit_code == 1 and (~gate.to_pandas()["passed"]).any()
    assert lp.check(["a91a0002"], baseline=run, max_worsening=2.5).passed
    d = lp.diff("a91a0001", "a91a0002")
    assert "widened the mean gap 2x" in d.headline and len(d.to_pandas()) > 0


@pytest.mark.engine
def test_compare_and_rescore_from_python(tiny_bos, home, tmp_path):
    """What a notebook cell does: compare two dtypes, gate them, and rescore a rollout it logged."""
    import json

    f32, bf16 = lp.compare(
        "Shall I compare thee to a summer's day?", model=str(tiny_bos), dtypes="float32,bfloat16", device="cpu"
    )
    assert f32.dtype == "float32" and bf16.summary["mean_abs_delta"] > f32.summary["mean_abs_delta"]
    frame = bf16.to_pandas()
    assert {"hf_logprob", "vllm_logprob", "abs_delta"} <= set(frame.columns) and frame["scored"].sum() == bf16.summary["n_tokens"]
    assert lp.check([f32], max_abs_delta=1e-3).passed
    assert lp.load(f32.run_id).summary == f32.summary
    ids = list(f32.sequences[0].token_ids)
    logged = tmp_path / "logged.jsonl"
    logged.write_text(
        json.dumps(
            {
                "prompt_token_ids": ids[:4],
                "completion_token_ids": ids[4:],
                "rollout_log_probs": [float(x) for x in f32.sequences[0].vllm.logprob[4:]],
            }
        )
        + "\n"
    )
    (ro,) = lp.rescore(logged, model=str(tiny_bos), dtypes="float32", device="cpu", map="logprobs=rollout_log_probs")
    table = ro.to_pandas()
    assert len(table) == len(ids) - 4
    # the logged logprobs were vLLM prefill's own: decode_vs_prefill is exactly 0, decode_vs_hf the float32 gap
    assert ro.meta.summary["decode_vs_prefill"]["max_abs_delta"] == 0.0
    assert ro.meta.summary["decode_vs_hf"]["max_abs_delta"] < 1e-3
