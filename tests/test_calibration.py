"""Calibration of the judgement (issue 40), on the real HF and vLLM engines of this CPU: pure noise
reads as noise, and a known fault reads as beyond it.

- HF against itself (`compare --null`: each text fed through HF's KV cache in chunks, against one
  pass) over 20 texts, in float32 and bfloat16: at most 1% of tokens beyond the noise, and the level
  is the within-noise one ("match");
- HF's own logprobs, scored in one padded micro-batch of 20 as a trainer scores them, rescored as
  if they were a logged rollout: the same; and one logged token moved by 1.5 nats is `beyond`;
- the tiny Gemma 2 with HF forced to SDPA, which leaves out Gemma 2's attention soft-cap: beyond.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from families import build_family, family

import logprob_parity as lp
from logprob_parity.analysis.verdict import run_verdicts
from logprob_parity.results.bands import BANDS

pytestmark = pytest.mark.engine

SENTENCES = (Path(lp.__file__).parent / "data" / "sentences.txt").read_text().splitlines()
# 20 texts: the bundled sentences, and ten more of other kinds (code, numbers, CJK, Hebrew, emoji, a list)
TEXTS = (
    *SENTENCES,
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "In 2023 the population was 8,945,310, up 1.4% from 8,821,005 the year before.",
    "東京は日本の首都です。人口はおよそ千四百万人で、多くの美術館があります。",
    "שלום עולם, זהו משפט קצר בעברית כדי לבדוק את המודל.",
    "The party was great 🎉🎉 and everyone loved the cake 🍰!",
    "Ingredients: two eggs, 200 g flour, a pinch of salt, 300 ml milk.",
    "Q: What is the capital of Canada?\nA: Ottawa.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Dear Sir or Madam, I am writing to complain about the late delivery of my order.",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
)
MOST_BEYOND = 0.01  # the bound; the tail is the 99.5th percentile, so noise leaves about 0.5% beyond it


def noise_reading(r) -> dict:
    """What a reader is shown of one run: its verdict level and its tokens' bands."""
    frame = r.to_frame()
    bands = frame["band"].dropna()
    return {
        "level": run_verdicts([r])[0].level,
        "beyond_noise": float((bands != "noise").mean()),
        "red": float((bands == "beyond").mean()),
        "n": len(bands),
        "bands": set(bands),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_against_itself_reads_as_noise_with_at_most_one_token_in_a_hundred_beyond(demo_model, home, dtype):
    (r,) = lp.compare(list(TEXTS), model=str(demo_model), dtypes=dtype, device="cpu", null=True, home=str(home), progress=False)
    got = noise_reading(r)
    print(dtype, "null", got, {k: r.summary.get(k) for k in ("mean_abs_delta", "hf_noise_mean", "hf_noise_tail")})
    assert r.meta.backends == ("hf", "hf_null") and r.summary["mean_abs_delta"] > 0  # HF really moved against itself
    assert got["n"] > 400 and got["bands"] <= set(BANDS)
    assert got["beyond_noise"] <= MOST_BEYOND and got["red"] <= MOST_BEYOND, got
    assert got["level"] == "match", run_verdicts([r])[0]
    assert run_verdicts([r])[0].headline.startswith("What noise looks like (HF against itself, no vLLM)")


def _trainer_logged(model: Path, dtype: str, prompt: int = 4) -> list[dict]:
    """Each text as a logged rollout whose logprobs are HF's own, every text in one right-padded
    micro-batch (a trainer's forward), float32 log_softmax as everywhere."""
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.tokens import encode_texts, load_tokenizer

    tok = load_tokenizer(str(model))
    ids, _ = encode_texts(tok, list(TEXTS), "auto")
    hf = HFBackend(str(model), dtype, "cpu", EngineSettings(), 2048)
    scores = hf.score(ids, 1, None, len(ids), "right")
    return [
        {
            "prompt_token_ids": s[:prompt],
            "completion_token_ids": s[prompt:],
            "logprobs": sc.logprob[prompt:].tolist(),
            "id": f"t{i}",
        }
        for i, (s, sc) in enumerate(zip(ids, scores))
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_logs_from_another_micro_batch_rescored_read_as_noise_and_a_token_moved_15_nats_is_beyond(demo_model, home, dtype):
    logged = _trainer_logged(demo_model, dtype)
    data = "\n".join(json.dumps(x) for x in logged).encode()
    (ro,) = lp.rescore(
        data, model=str(demo_model), dtypes=dtype, name="trainer.jsonl", device="cpu", home=str(home), progress=False
    )
    frame = ro.to_frame()
    bands = frame["band"].dropna()
    main = ro.meta.summary["decode_vs_hf"]
    print(
        dtype,
        "rescored",
        main["mean_abs_delta"],
        main["tokens_beyond_frac"],
        main["tokens_above_noise_frac"],
        ro.meta.verdict["level"],
    )
    assert len(bands) > 300 and main["mean_abs_delta"] > 0
    assert float((bands != "noise").mean()) <= MOST_BEYOND and main["tokens_above_noise_frac"] <= MOST_BEYOND
    assert ro.meta.verdict["level"] == "match", ro.meta.verdict

    moved = [dict(x) for x in logged]
    moved[3] = {**moved[3], "logprobs": list(moved[3]["logprobs"])}
    moved[3]["logprobs"][2] -= 1.5
    data = "\n".join(json.dumps(x) for x in moved).encode()
    (ro2,) = lp.rescore(
        data, model=str(demo_model), dtypes=dtype, name="moved.jsonl", device="cpu", home=str(home), progress=False
    )
    f2 = ro2.to_frame()
    at = f2[(f2["sample"] == 3) & (f2["position"] == 2)]["band"]
    assert list(at) == ["beyond"]
    assert (f2["band"] == "beyond").sum() == (bands == "beyond").sum() + 1  # that token, and nothing else moved


def test_gemma2_with_hf_forced_to_sdpa_which_drops_the_soft_cap_is_beyond_the_noise(home):
    path = build_family(family("gemma2"))
    (r,) = lp.compare(
        ["The committee will meet on Thursday to review the budget for the new library."],
        model=str(path),
        dtypes="float32",
        device="cpu",
        settings={"attn_implementation": "sdpa"},
        home=str(home),
        progress=False,
    )
    got = noise_reading(r)
    print("gemma2 sdpa", got, r.summary["mean_abs_delta"], r.summary["hf_noise_tail"])
    assert got["beyond_noise"] > 0.5 and got["red"] > 0.2 and got["level"] in ("close", "differs"), run_verdicts([r])[0]
    assert np.isfinite(r.summary["hf_noise_tail"])
