"""Colour and words agree: the meaning scale against the verdict, one dtype palette everywhere,
and progress described in words."""

from __future__ import annotations

import json
import re

import pytest
from test_store import make_run

from logprob_parity.analysis.verdict import VLLM_TEST_TOL, run_verdicts
from logprob_parity.present.charts import CHARTS, chart_frame
from logprob_parity.present.palette import DTYPE_COLOURS
from logprob_parity.present.render import AMBER_HI, NEUTRAL, RED_HI, RED_LO, meaning_scale, token_view_html
from logprob_parity.present.report import report_html


def test_meaning_scale_is_neutral_within_the_noise_tail_amber_to_the_tolerance_and_red_beyond():
    s = meaning_scale("float32", 1e-6)
    assert s.source == "tail" and s.rgb(5e-7) == NEUTRAL and s.rgb(1e-6) == NEUTRAL
    mid = s.rgb(1e-4)
    assert mid not in (NEUTRAL, RED_LO) and mid[2] < mid[0]  # a warm, not a red, tone
    assert s.rgb(VLLM_TEST_TOL[0]) == AMBER_HI
    assert s.rgb(0.05)[0] > 150 and s.rgb(0.05)[1] < 80  # red
    assert s.rgb(10.0) == RED_HI
    assert not s.dark(VLLM_TEST_TOL[1]) and s.dark(0.03)
    unmeasured = meaning_scale("bfloat16")
    assert unmeasured.source == "unmeasured" and unmeasured.limit == 2.0**-7


def _red(style: str) -> bool:
    r, g, b = map(int, re.search(r"rgb\((\d+),(\d+),(\d+)\)", style).groups())
    return r > 150 and g < 80 and b < 80


def _run_of(scale: float, summary_extra: dict | None = None):
    """A bfloat16 run of four tokens whose vLLM side sits `scale` (growing along the text) off HF's."""
    from test_store import _scores

    from logprob_parity.inputs.tokens import TokenizedText
    from logprob_parity.results.metrics import concat, summarize
    from logprob_parity.results.records import RunMeta
    from logprob_parity.results.run import Run, SequenceResult

    ids = [1, 10, 11, 12, 13]
    toks = ("<s>", "a", "b", "c", "d")
    seq = SequenceResult.build(
        TokenizedText("abcd", tuple(ids), toks, toks, True), _scores(ids, 0.0, gather=True), _scores(ids, scale)
    )
    summary = {**summarize(concat([seq.metrics])), **(summary_extra or {})}
    meta = RunMeta.from_dict(
        {
            "run_id": "ab12",
            "model": "m",
            "revision": None,
            "dtype": "bfloat16",
            "backends": ["hf", "vllm"],
            "settings": {},
            "top_k": 2,
            "bos": "auto",
            "summary": summary,
            "sequences": [{"text": "abcd", "bos_added": True, "summary": summary}],
        }
    )
    return Run(meta=meta, sequences=(seq,)), seq


@pytest.mark.parametrize("scale", [1e-3, 3e-2])
def test_red_tokens_the_data_bands_and_the_verdict_tell_the_same_story(scale):
    """A token is red exactly when it is beyond vLLM's tolerance and (here unmeasured) HF's noise; its
    `band` in the JSON and the frame says the same, and the verdict says so exactly then."""
    run, seq = _run_of(scale)
    styles = re.findall(r'class="lpp-tok[^"]*" style="([^"]+)"', token_view_html([run], 0))
    red = [_red(s) for s in styles]
    beyond = [bool(v > VLLM_TEST_TOL[1]) for v in seq.metrics.abs_delta[seq.metrics.scored]]
    assert red == beyond
    frame = run.to_frame()
    assert [b == "beyond" for b in frame["band"][frame["scored"]]] == beyond
    positions = run.to_json_dict()["sequences"][0]["positions"]
    assert [p["band"] == "beyond" for p in positions if p["abs_delta"] is not None] == beyond
    assert positions[0]["band"] is None  # the unscored first position has no band
    (v,) = run_verdicts([run])
    assert ("differ by more than HF's own noise and vLLM's own tests allow" in " ".join(v.reasons)) == any(beyond)
    assert v.level == ("close" if any(beyond) else "unmeasured")  # no noise floor in this made-up run
    from logprob_parity.analysis.verdict import with_verdict

    assert with_verdict(run).to_json_dict()["verdict"] == v.to_dict()


def test_a_token_within_the_noise_tail_is_noise_in_colour_data_and_verdict_though_above_the_mean_floor():
    """The issue's bfloat16 case: the mean floor is 0.037 but HF moves a token by up to 0.11 itself.
    Tokens between the two are noise: neutral, band `noise`, and no red token in the verdict."""
    tail = {"hf_noise_mean": 0.037, "hf_noise_tail": 0.11, "noise_tail_q": 0.99, "noise_tail_positions": 480}
    run, seq = _run_of(0.06, {**tail, "noise_ratio": 1.6})
    ad = seq.metrics.abs_delta[seq.metrics.scored]
    assert (ad > 0.037).any() and (ad <= 0.11).all()  # above the mean floor, within the tail
    html = token_view_html(
        [run], 0, floors={"bfloat16": 0.11}, floor_words={"bfloat16": "HF moved 99% of 480 tokens by at most 0.11"}
    )
    assert not any(_red(s) for s in re.findall(r'class="lpp-tok[^"]*" style="([^"]+)"', html))
    assert set(run.to_frame()["band"].dropna()) == {"noise"}
    (v,) = run_verdicts([run])
    assert v.level == "match" and "vLLM is as far from HF as HF is from itself" in v.headline
    assert "HF moved 99% of 480 tokens by at most 0.11 against itself" in " ".join(v.reasons)


def test_legend_says_where_red_starts_and_why_and_when_the_noise_is_not_measured():
    html = token_view_html([make_run("ab34")], 0)
    assert "float32: HF’s own noise is not measured" in html and "one rounding step, 1.2e-07, stands in" in html
    assert f"within vLLM’s test tolerance (≤ {VLLM_TEST_TOL[0]:g}" in html and "beyond both HF’s noise and vLLM’s" in html
    measured = token_view_html(
        [make_run("ab34")],
        0,
        floors={"float32": 3e-6},
        floor_words={"float32": "HF moved 99% of 480 tokens by at most 3e-06 against itself"},
    )
    assert "float32 ≤ 3e-06 (HF moved 99% of 480 tokens by at most 3e-06 against itself)" in measured
    assert "float32: red from 0.02, vLLM’s loose tolerance" in measured and "not measured" not in measured
    zero = token_view_html([make_run("ab34")], 0, floors={"float32": 0.0})
    assert "float32: 0 (HF gave identical values against itself)" in zero and "not measured" not in zero
    raw = token_view_html([make_run("ab34")], 0, raw=True)
    assert "raw log scale" in raw and "within HF’s own noise" not in raw


def test_colour_bands_are_ordered_and_a_token_within_a_tail_above_the_tolerance_is_not_a_problem():
    """bfloat16's noise tail lies above vLLM's tolerance: a token up to it is neutral, never red, the
    legend says so in words, and the bands never overlap (noise, then tolerance, then beyond)."""
    s = meaning_scale("bfloat16", 0.043, "HF moved 99% of 480 tokens by at most 0.043 against itself")
    assert s.rgb(0.030) == NEUTRAL and s.band(0.030) == "noise" and not s.dark(0.030)
    assert s.rgb(0.043) == NEUTRAL
    r, g, b = s.rgb(0.05)
    assert s.band(0.05) == "beyond" and r > 150 and g < 80 and b < 80 and s.dark(0.05)
    ordered = [s.band(v) for v in (1e-9, 0.02, 0.043, 0.0431, 1.0)]
    assert ordered == ["noise", "noise", "noise", "beyond", "beyond"]
    low = meaning_scale("bfloat16", 1e-3)
    bands = [low.band(v) for v in (5e-4, 1e-3, 2e-3, 1e-2, 2e-2, 2.1e-2)]
    assert bands == ["noise", "noise", "tolerance", "tolerance", "tolerance", "beyond"]
    rank = {"noise": 0, "tolerance": 1, "beyond": 2}
    grid = [10 ** (k / 10) for k in range(-90, 10)]
    for scale in (s, low, meaning_scale("float32", 1e-6), meaning_scale("float32", 0.0)):
        seen = [rank[scale.band(v)] for v in grid]
        assert seen == sorted(seen), scale  # bands in order along |Δ logp|: never interleaved
    html = token_view_html([make_run("ab35", dtype="bfloat16")], 0, floors={"bfloat16": 0.043})
    assert "bfloat16: red from 0.043, HF’s own noise, which lies above vLLM’s tolerance of 0.02" in html
    assert "a token within it is noise, not a problem" in html


def test_the_verdict_never_calls_a_token_within_the_noise_tail_a_problem():
    from logprob_parity.analysis.verdict import BEYOND_WORDS, Evidence, verdict

    summary = {"max_abs_delta": 0.030, "mean_abs_delta": 0.012, "argmax_agreement": 1.0}
    within = verdict(summary, "bfloat16", Evidence(noise_ratio=0.012 / 0.01, hf_noise=0.01, noise_tail=0.043))
    assert within.level == "match" and BEYOND_WORDS not in " ".join(within.reasons)
    assert "No token is beyond both HF's own noise" in " ".join(within.reasons)
    above = verdict(summary, "bfloat16", Evidence(noise_ratio=0.012 / 0.005, hf_noise=0.005, noise_tail=0.012))
    assert BEYOND_WORDS in " ".join(above.reasons)


def test_one_palette_in_the_token_view_the_charts_and_the_report():
    runs = [make_run("ab56", dtype="bfloat16"), make_run("ab57", dtype="float32")]
    view = token_view_html(runs, 0)
    for d in ("bfloat16", "float32"):
        assert f'background:{DTYPE_COLOURS[d]}"></span>{d}' in view
    df = chart_frame(runs)
    for make in CHARTS.values():
        spec = json.dumps(make(df).to_dict())
        assert DTYPE_COLOURS["bfloat16"] in spec and DTYPE_COLOURS["float32"] in spec
    page = report_html(runs)
    assert DTYPE_COLOURS["bfloat16"] in page and DTYPE_COLOURS["float32"] in page
    assert len(set(DTYPE_COLOURS.values())) == len(DTYPE_COLOURS)


def test_progress_is_said_in_words():
    from logprob_parity.dashboard.components.runner import describe

    assert describe("queue", "float32", "waiting for another job on the device (2 in line)").startswith(
        "Waiting for another job [float32]: waiting for another job on the device (2 in line)"
    )
    assert describe("load", "bfloat16", "hf: starting the engine").startswith("Engines [bfloat16]")
    assert describe("resolve", None, "model demo").startswith("Finding the model")


def test_the_rollout_histograms_are_drawn_in_their_own_dtypes_colour():
    import pandas as pd

    from logprob_parity.present.palette import dtype_colour
    from logprob_parity.present.rollout_view import delta_histogram, ratio_histogram

    df = pd.DataFrame({"abs_delta_plot": [1e-3, 2e-2, 1e-1], "ratio": [0.9, 1.0, 1.3]})
    for dtype in ("bfloat16", "float32"):
        deltas = delta_histogram(df, dtype).to_dict()
        ratios = ratio_histogram(df, dtype).to_dict()
        assert deltas["mark"]["color"] == dtype_colour(dtype)
        assert ratios["layer"][0]["mark"]["color"] == dtype_colour(dtype)
        assert dtype in deltas["title"]["text"] and dtype in ratios["title"]["text"]
