"""The one verdict function: its level and wording from summaries and diagnostics built like real
ones (the H200 float32 case: inside vLLM's tolerance, 345x HF's own noise, vLLM ~350x farther from
float64, one attention backend removing 99.8% of the gap), and the same words in every consumer."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_store import make_run

from logprob_parity.analysis.verdict import BEYOND_WORDS, Evidence, diagnosis_verdicts, run_verdicts, verdict
from logprob_parity.present.diagnostics_view import diagnostics_text
from logprob_parity.present.render import verdict_html
from logprob_parity.present.report import report_html
from logprob_parity.results.records import DiagnosticsResult
from logprob_parity.results.store import Store

APP = str(Path(__file__).resolve().parent.parent / "logprob_parity" / "dashboard" / "app.py")


def summary(max_abs: float, mean_abs: float, agree: float = 1.0) -> dict:
    return {"max_abs_delta": max_abs, "mean_abs_delta": mean_abs, "argmax_agreement": agree}


def h200_float32(run_id: str = "f32a1b", mean: float = 4.6e-4, max_abs: float = 4.1e-3, **gap: float) -> DiagnosticsResult:
    """Shaped like the stored diagnostics of the H200 float32 run (vLLM 0.26.0, default attention)."""
    hf_noise = mean / 345.0
    return DiagnosticsResult.from_dict(
        {
            "diagnostics_id": "d1",
            "model": "demo",
            "device": "NVIDIA H200",
            "versions": {},
            "texts": ["t"],
            "parts": ["noise", "reference", "ablation"],
            "run_ids": {"float32": run_id},
            "dtypes": {
                "float32": {
                    "run_id": run_id,
                    "gap": {"mean": mean, "max": max_abs, "argmax_agreement": 1.0, **gap},
                    "verdict": {},
                    "noise": {"hf_batched_right_padding": {"mean": hf_noise, "max": 1e-5, "n": 30}},
                    "floor": {"hf": hf_noise, "vllm": 0.0},
                    "ratio_to_hf_noise": 345.0,
                    "ratio_to_vllm_noise": None,
                    "reference": {
                        "vllm_vs_ref": {"mean": 4.55e-4, "max": 4e-3},
                        "hf_vs_ref": {"mean": 1.3e-6, "max": 1e-5},
                        "frac_tokens_vllm_closer": 0.02,
                        "frac_tokens_tied": 0.0,
                        "closer_overall": "HF",
                    },
                }
            },
            "ablation": [
                {"dtype": "float32", "knob": "baseline", "mean_abs_delta": mean, "max_abs_delta": max_abs, "change": 0.0},
                {
                    "dtype": "float32",
                    "knob": "vLLM attention_backend=TRITON_ATTN",
                    "mean_abs_delta": mean * 0.9,
                    "max_abs_delta": max_abs,
                    "change": -mean * 0.1,
                },
                {
                    "dtype": "float32",
                    "knob": "vLLM attention_backend=FLEX_ATTENTION",
                    "mean_abs_delta": mean * 0.002,
                    "max_abs_delta": 1e-5,
                    "change": -mean * 0.998,
                },
                {"dtype": "float32", "knob": "vLLM fp32 LM head", "mean_abs_delta": None, "max_abs_delta": None, "change": None},
            ],
        }
    )


def test_a_gap_inside_tolerance_but_far_above_the_noise_is_systematic_not_a_match():
    (v,) = diagnosis_verdicts(h200_float32()).values()
    assert v.level == "systematic" and v.title == "Small but systematic"
    assert "within vLLM's test tolerance, but systematic: 345x HF's own mean noise" in v.headline
    assert "vLLM is 350x farther from the float64 reference than HF" in v.headline
    assert "vLLM attention_backend=FLEX_ATTENTION removes 99.8% of the gap" in v.headline
    text = " ".join(v.reasons)
    assert "comes from vLLM's side" in text and "systematic, not what a trainer's own batching" in text


def test_the_same_gap_with_no_noise_measured_is_not_called_a_match():
    """Without any floor (no diagnostics, a comparison run without its own), the verdict says the
    noise is not yet measured rather than "match"."""
    v = verdict(summary(4.1e-3, 4.6e-4), "float32")
    assert v.level == "unmeasured" and "not yet measured" in v.headline and "agree" not in v.headline
    assert v.title == "Within tolerance, noise not yet measured"


def test_a_comparisons_own_floor_makes_its_verdict_the_diagnostics_level():
    """A run's summary carries its own floor (logprob_parity.analysis.floors): many times the gap's size below
    it is systematic, in the verdict every view shows; about its size is a match."""
    from logprob_parity.analysis.verdict import run_verdicts

    class R:
        dtype, run_id = "float32", "r1"

    for ratio, level in ((346.0, "systematic"), (1.7, "match")):
        r = R()
        r.summary = {**summary(4.1e-3, 4.6e-4), "hf_noise_mean": 4.6e-4 / ratio, "noise_ratio": ratio}
        (v,) = run_verdicts([r])
        assert v.level == level, (ratio, v)
        assert v == verdict(r.summary, "float32", Evidence(noise_ratio=ratio, hf_noise=4.6e-4 / ratio))
    r = R()
    r.summary = {**summary(4.1e-3, 4.6e-4), "hf_noise_mean": 0.0, "noise_ratio": None}
    (v,) = run_verdicts([r])
    assert v.level == "systematic" and "noise measured 0" in " ".join(v.reasons)


def test_a_gap_about_as_large_as_hf_own_noise_is_a_match():
    v = verdict(summary(4.1e-3, 4.6e-4), "float32", Evidence(noise_ratio=2.0))
    assert v.level == "match" and "HF's own noise" in v.headline
    assert any("about what HF does to itself" in r for r in v.reasons)


def counted(s: dict, n: int, beyond: int, above: int | None = None, material: int = 0, flips: int = 0) -> dict:
    """A summary with its band counts (logprob_parity.results.bands), as a comparison stores them."""
    return {
        **s,
        "n_tokens": n,
        "tokens_beyond": beyond,
        "tokens_above_noise": beyond if above is None else above,
        "material_beyond": material,
        "argmax_flips": flips,
    }


def test_more_tokens_beyond_noise_and_tolerance_than_noise_gives_are_close_in_words_that_fit_the_cli_too():
    ev = Evidence(noise_ratio=3.0, hf_noise=1.3e-3, noise_tail=0.012, tail_words="HF moved 99% of 400 tokens by at most 0.012")
    v = verdict(counted(summary(0.05, 4e-3), 200, 12), "bfloat16", ev)
    assert v.level == "close" and "beyond both HF's own noise and vLLM's test tolerance" in v.headline
    assert any(r.startswith(BEYOND_WORDS) and "12 of 200 tokens (6.0%)" in r and "more than noise" in r for r in v.reasons)
    assert not any("token view" in r for r in v.reasons)  # the CLI has none; the pages say where the tokens are


def test_a_red_token_at_the_rate_noise_gives_leaves_the_level_within_the_noise():
    """One token in 1,000 beyond the noise's 99th percentile is what noise itself gives: named, not the level."""
    ev = Evidence(noise_ratio=1.2, hf_noise=0.03, noise_tail=0.11, tail_words="HF moved 99% of 900 tokens by at most 0.11")
    v = verdict({**counted(summary(0.4, 0.036), 1000, 1, material=0), "max_prob_delta": 0.004}, "bfloat16", ev)
    assert v.level == "match", v
    assert v.headline.startswith("bfloat16: vLLM is as far from HF as HF is from itself")
    assert any("1 of 1,000 tokens (0.1%)" in r and "what noise gives" in r for r in v.reasons)


def test_one_improbable_token_with_a_large_ratio_cannot_set_a_sets_level():
    """The issue's Hebrew token: logp -20.6 against -18.9 (5.5x) is a probability change of 5e-9."""
    ev = Evidence(noise_ratio=1.9, hf_noise=0.045, noise_tail=0.13)
    s = {**counted(summary(1.7, 0.082), 400, 1, material=0), "max_prob_delta": 5e-9}
    v = verdict(s, "bfloat16", ev)
    assert v.level == "match", v
    assert any("under the 0.1 that would matter" in r for r in v.reasons)


def test_tokens_beyond_the_noise_that_move_a_probability_materially_change_results():
    ev = Evidence(noise_ratio=30.0, hf_noise=0.01, noise_tail=0.05)
    v = verdict({**counted(summary(1.2, 0.3), 300, 90, material=12), "max_prob_delta": 0.4}, "bfloat16", ev)
    assert v.level == "differs" and "12 token(s) beyond HF's noise move a probability by 0.1 or more" in v.headline


def test_argmax_flips_are_judged_against_hf_own_flips():
    ev = Evidence(noise_ratio=1.0, hf_noise=0.01, noise_tail=0.05, noise_flip_frac=0.01, noise_flip_n=1000)
    same = verdict(counted(summary(0.04, 0.01), 1000, 0, flips=12), "bfloat16", ev)
    more = verdict(counted(summary(0.04, 0.01), 1000, 0, flips=80), "bfloat16", ev)
    assert same.level == "match" and any("no more than HF's own" in r for r in same.reasons)
    assert more.level == "differs" and "more often than HF changes its own" in more.headline


@pytest.mark.parametrize(
    "s,level",
    [(summary(0.3, 0.15), "differs"), ({**summary(2.0, 0.01), "max_prob_delta": 0.5}, "differs"), (summary(2.0, 0.01), "close")],
)
def test_without_a_floor_a_large_mean_or_a_material_token_differs_but_a_ratio_alone_does_not(s, level):
    assert verdict(s, "float16").level == level


def test_hf_farther_from_the_reference_is_said_the_other_way_round():
    v = verdict(summary(4e-3, 5e-4), "float32", Evidence(noise_ratio=50.0, vllm_to_ref=1e-6, hf_to_ref=5e-4))
    assert v.level == "systematic" and "HF is 500x farther from the float64 reference than vLLM" in v.headline
    assert any("comes from HF's side" in r for r in v.reasons)


def test_a_knob_that_removes_little_is_not_offered_as_the_fix():
    v = verdict(summary(4e-3, 5e-4), "float32", Evidence(noise_ratio=50.0, knob="vLLM prefix caching on", knob_share=0.1))
    assert "prefix caching" not in v.headline and not any("prefix caching" in r for r in v.reasons)


def test_nothing_scored_says_so():
    v = verdict({"max_abs_delta": None, "mean_abs_delta": None}, "float32")
    assert v.level == "differs" and "nothing was scored" in v.headline


def test_cli_report_and_compare_page_say_the_same_verdict(home):
    run = make_run("f32a1b")
    s = run.summary
    diag = h200_float32("f32a1b", mean=s["mean_abs_delta"], max_abs=s["max_abs_delta"], max_prob_delta=s["max_prob_delta"])
    (expected,) = run_verdicts([run], diag)
    assert expected == next(iter(diagnosis_verdicts(diag).values()))
    assert expected.level == "systematic"
    assert expected.headline in diagnostics_text(diag)  # the CLI's `diagnose` output
    assert expected.headline.replace("'", "&#x27;") in report_html([run], diag)  # the HTML report
    assert expected.headline.replace("'", "&#x27;") in verdict_html([expected.to_dict()])
    store = Store(home)
    store.save(run)
    store.save_diagnostics(diag)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "f32a1b"
    at.run()
    assert not at.exception
    assert any(expected.headline in w.value for w in at.warning)  # a systematic verdict is a warning box


def test_a_tiny_gap_reads_as_a_change_in_words_that_parse():
    v = verdict(summary(1e-7, 5e-8), "float32", Evidence(noise_ratio=1.0))
    first = next(r for r in v.reasons if r.startswith("The largest gap"))
    assert "a change of under 0.01% in one token's probability" in first and "a under" not in first, first


def test_closer_to_float64_has_one_rule_for_the_verdict_and_the_diagnostics_table():
    """Issue 40: Diagnostics said "both about as far (vLLM 8.47e-06, HF 9.82e-06)" and right below it
    "closer overall: vLLM". One rule now: closer only when the other engine is 2x farther."""
    from logprob_parity.analysis.diagnostics import diagnostics_tables
    from logprob_parity.analysis.verdict import closer_to_reference

    assert closer_to_reference(8.47e-6, 9.82e-6) == "neither"
    assert closer_to_reference(4.55e-4, 1.3e-6) == "HF" and closer_to_reference(1e-6, 5e-4) == "vLLM"
    assert closer_to_reference(None, 1e-6) is None
    diag = h200_float32()
    ref = diag.dtypes["float32"].reference
    ref["vllm_vs_ref"]["mean"], ref["hf_vs_ref"]["mean"] = 8.47e-6, 9.82e-6
    (v,) = diagnosis_verdicts(diag).values()
    (row,) = diagnostics_tables(diag)["reference"]
    assert row["closer overall"] == "neither" and any("so neither is closer" in r for r in v.reasons)
