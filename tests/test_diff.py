"""Two runs of the same model and token ids, side by side: what changed, and how the gap moved."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest
from test_check import _stored

from logprob_parity.analysis.diff import diff_runs
from logprob_parity.cli import main
from logprob_parity.errors import UserError
from logprob_parity.results.store import Store

APP = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "logprob_parity" / "dashboard" / "app.py")


def test_a_wider_run_reads_as_widened_with_what_changed(home):
    import dataclasses

    a = _stored(home, "d1ff0001")
    b = _stored(home, "d1ff0002", scale=3.0)
    b = dataclasses.replace(b, meta=dataclasses.replace(b.meta, dtype="bfloat16", settings={"enforce_eager": False}))
    d = diff_runs(a, b)
    assert d.mean_b == pytest.approx(3 * d.mean_a) and d.share_wider == 1.0 and d.share_narrower == 0.0
    assert ("dtype", "float32", "bfloat16") in d.changes and ("enforce_eager", None, False) in d.changes
    assert d.headline.startswith("dtype float32 → bfloat16; enforce_eager None → False widened the mean gap 3x")
    assert d.movers[0]["ratio"] == pytest.approx(3.0) and d.movers[0]["gap_b"] > d.movers[0]["gap_a"]
    back = diff_runs(b, a)
    assert "narrowed the mean gap 3x" in back.headline


def test_a_setting_that_took_no_effect_and_a_change_within_both_runs_noise_say_so(home):
    """The issue's case: attention_backend=FLASH_ATTN on the CPU build ran CPU_ATTN, as the default did,
    and a 1.06x change of a float32 gap is within HF's own noise: neither is credited with a change."""
    import dataclasses

    a = _stored(home, "d1ff0011")
    b = _stored(home, "d1ff0012", scale=1.06)

    def ran(run, settings: dict, floor: float):
        env = dataclasses.replace(run.meta.env, vllm_engine={"attention_backend": "CPU_ATTN"})
        summary = {**run.summary, "hf_noise_mean": floor}
        return dataclasses.replace(run, meta=dataclasses.replace(run.meta, settings=settings, env=env, summary=summary))

    a = ran(a, {}, a.summary["mean_abs_delta"])
    b = ran(b, {"attention_backend": "FLASH_ATTN"}, a.summary["mean_abs_delta"] * 0.8)
    d = diff_runs(a, b)
    assert ("attention_backend", None, "FLASH_ATTN (no effect: attention_backend CPU_ATTN ran in both)") in d.changes
    assert "moved the mean gap within the noise of both runs" in d.headline and "widened" not in d.headline
    far = diff_runs(a, ran(_stored(home, "d1ff0013", scale=5.0), {}, a.summary["mean_abs_delta"]))
    assert "widened the mean gap 5x" in far.headline  # beyond both runs' noise: still said


def test_runs_of_other_texts_are_refused_in_words(home):
    a = _stored(home, "d1ff0003")
    b = _stored(home, "d1ff0004", texts=("other", "texts here"))
    with pytest.raises(UserError, match="compared different texts"):
        diff_runs(a, b)


def test_the_cli_prints_the_diff_and_writes_json(home, tmp_path, capsys):
    _stored(home, "d1ff0005")
    _stored(home, "d1ff0006", scale=0.5)
    out = tmp_path / "d.json"
    assert main(["diff", "d1ff0005", "d1ff0006", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "narrowed the mean gap 2x" in text and "tokens whose gap moved most" in text
    data = json.loads(out.read_text())
    assert data["a"] == "d1ff0005" and data["mean_abs_delta"]["b"] < data["mean_abs_delta"]["a"]
    assert main(["diff", "d1ff0005", "feedfeed"]) == 2


def test_identical_runs_list_no_mover_and_a_zero_gap_in_a_reads_a_is_0(home, capsys):
    """Item 9 of the first hour: the CLI listed 10 "tokens whose gap moved most", each "(1x)", for two
    identical runs, and the page's B / A column read 2.384e+6 where A's gap was 0."""
    import dataclasses

    import numpy as np

    from logprob_parity.analysis.diff import ratio_words

    _stored(home, "d1ff0021")
    _stored(home, "d1ff0022")
    same = diff_runs(Store(home).load("d1ff0021"), Store(home).load("d1ff0022"))
    assert same.movers == () and same.mean_a == same.mean_b
    assert main(["diff", "d1ff0021", "d1ff0022"]) == 0
    out = capsys.readouterr().out
    assert "no token moved" in out and "(1x)" not in out
    a = _stored(home, "d1ff0023", scale=0.0)  # vLLM equals HF at every token: every gap of A is 0
    b = _stored(home, "d1ff0024")
    d = diff_runs(a, b)
    assert d.mean_a == 0 and d.movers and all(m["ratio"] is None and ratio_words(m) == "A is 0" for m in d.movers)
    assert "moved the mean gap from 0.00e+00 to" in d.headline and "A's is 0: no ratio to give" in d.headline
    assert "widened" not in d.headline  # it read "widened the mean gap 1.5e+09x"
    assert main(["diff", "d1ff0023", "d1ff0024"]) == 0
    assert "(A is 0)" in capsys.readouterr().out
    assert ratio_words({"ratio": 3.0}) == "3x" and np.isfinite(d.mean_b)
    assert dataclasses.asdict(d)  # still plain data


def test_the_diff_page_opens_from_a_link_and_says_what_moved(home):
    import streamlit as st

    st.cache_resource.clear()  # the store handle of another test's home must not serve this one
    _stored(home, "d1ff0007")
    _stored(home, "d1ff0008", scale=4.0)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/diff.py")
    at.query_params["diff"] = "d1ff0007,d1ff0008"
    at.run()
    assert not at.exception
    assert any("widened the mean gap 4x" in w.value for w in at.warning)
    assert len(at.dataframe) >= 1
    at.query_params["diff"] = "d1ff0007,feedfeed"
    at.run()
    assert not at.exception and any("no stored run" in e.value for e in at.error)
    st.cache_resource.clear()


@pytest.mark.engine
def test_diff_of_float32_and_bfloat16_runs_puts_the_larger_gap_on_bfloat16(demo_model, home):
    """Real engines on the demo model: the same text in float32 and bfloat16; the diff reads bfloat16 wider."""
    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec

    f32, bf16 = compare(
        RunSpec(
            texts=("The capital of France is Paris, a city of museums.",),
            model=str(demo_model),
            dtypes=("float32", "bfloat16"),
            device="cpu",
        ),
        store=Store(home),
    )
    d = diff_runs(f32, bf16)
    assert d.mean_b > 10 * d.mean_a and d.share_wider > 0.5
    assert ("dtype", "float32", "bfloat16") in d.changes and "widened the mean gap" in d.headline
