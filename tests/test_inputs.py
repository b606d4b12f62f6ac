"""Input validation and prompt files: each bad input gets one clear message."""

import json

import pytest

from logprob_parity.errors import UserError
from logprob_parity.inputs.prompts import parse_prompts
from logprob_parity.inputs.spec import MAX_TOP_K, EngineSettings, RunSpec, content_hash


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"texts": ()}, "no prompt given"),
        ({"texts": ("",)}, "the prompt is empty"),
        ({"texts": ("ok", "   \n\t")}, "prompt 2 is empty"),
        ({"dtypes": ("float8",)}, "unknown dtype 'float8'"),
        ({"dtypes": ()}, "no dtype given"),
        ({"dtypes": ("float32", "float32")}, "listed twice"),
        ({"backends": ("hf",)}, "needs both"),
        ({"top_k": 0}, "positive integer"),
        ({"top_k": MAX_TOP_K + 1}, f"above the maximum of {MAX_TOP_K}"),
        ({"device": "tpu"}, "unknown device"),
        ({"bos": "maybe"}, "unknown BOS policy"),
    ],
)
def test_spec_validation(kwargs, message):
    spec = RunSpec(**{"texts": ("hello there",), **kwargs})
    with pytest.raises(UserError, match=message):
        spec.validate()


def test_settings_roundtrip_and_hash_is_canonical():
    s = EngineSettings(enforce_eager=False, max_num_batched_tokens=64)
    assert EngineSettings.from_dict(s.to_dict()) == s
    with pytest.raises(UserError, match="unknown engine setting"):
        EngineSettings.from_dict({"warp_speed": True})
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})
    assert content_hash({"a": 1.0}) != content_hash({"a": 1.0000001})


def test_hf_compile_is_an_hf_setting_from_the_cli():
    """--hf-compile reaches HF's part of the settings (so HF's engine key and the run id) and not vLLM's;
    settings stored before the knob existed still load, with it off."""
    from logprob_parity.cli import _settings, build_parser

    args = build_parser().parse_args(["compare", "--prompt", "x", "--dtype", "float32", "--hf-compile"])
    on, off = _settings(args), EngineSettings()
    assert on.hf_compile and on.hf_part()["hf_compile"] and "hf_compile" not in on.vllm_part()
    assert on.vllm_part() == off.vllm_part() and on.hf_part() != off.hf_part()
    assert content_hash(on.to_dict()) != content_hash(off.to_dict())
    old = {k: v for k, v in off.to_dict().items() if k != "hf_compile"}
    assert EngineSettings.from_dict(old) == off


def test_txt_jsonl_csv():
    assert parse_prompts(b"one\n\n two \n", "p.txt").texts == ("one", " two ")
    data = "\n".join([json.dumps({"text": "a b"}), "{broken", json.dumps({"x": 1}), json.dumps({"text": "c"})])
    ps = parse_prompts(data.encode(), "p.jsonl")
    assert ps.texts == ("a b", "c")
    assert ps.skipped[0].startswith("line 2: not JSON") and ps.skipped[1].startswith("line 3")
    assert parse_prompts(b"id,text\n1,hello\n2,\n3,world\n", "p.csv").texts == ("hello", "world")


@pytest.mark.parametrize(
    "data, name, message",
    [
        (b"", "p.txt", "holds no prompts"),
        (b"\n  \n", "p.txt", "holds no prompts"),
        (b"id,prompt\n1,hi\n", "p.csv", "no 'text' column"),
        (b"\xff\xfe\x00bad", "p.txt", "not UTF-8"),
        (b"ok\x00ok", "p.txt", "looks binary"),
        (b"{not json}\n", "p.jsonl", "holds no prompts .1 bad entries: line 1"),
        (b"hi", "p.pdf", "unsupported file type"),
        (b"x" * (21 << 20), "p.txt", "limit is 20 MiB"),
    ],
)
def test_bad_prompt_files(data, name, message):
    with pytest.raises(UserError, match=message):
        parse_prompts(data, name)
