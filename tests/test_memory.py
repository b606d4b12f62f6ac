"""Memory sizing and the parallel plan: model sizes read from real files; GPU lists are given (no GPU here)."""

import dataclasses

import pytest

from logprob_parity.engines import memory, parallel
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import EngineSettings

H200 = memory.GPU(0, "NVIDIA H200", 141 * memory.GIB, 140 * memory.GIB)


def test_param_count_reads_the_safetensors_headers(tiny_bos):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_bos))
    assert not model.config.tie_word_embeddings
    assert memory.param_count(str(tiny_bos)) == sum(p.numel() for p in model.parameters())
    assert memory.weight_bytes(str(tiny_bos), "float32") == 2 * memory.weight_bytes(str(tiny_bos), "bfloat16")


def test_kv_cache_is_sized_from_the_model(tiny_bos):
    cfg = memory.text_config(str(tiny_bos), False)
    per_token = (
        2
        * cfg.num_hidden_layers
        * (cfg.num_key_value_heads or cfg.num_attention_heads)
        * (cfg.hidden_size // cfg.num_attention_heads)
        * 4
    )
    assert memory.kv_bytes_per_token(str(tiny_bos), "float32") == per_token
    # tiny models hit the 64 MiB floor; the GPU asks for more tokens than the CPU
    assert memory.kv_cache_bytes(str(tiny_bos), "float32", 256, "cpu") == 64 << 20
    assert memory.kv_cache_bytes(str(tiny_bos), "float32", 1 << 20, "cuda") == 4 * memory.GIB
    # past the 4 GiB cap the cache still holds one whole sequence: a long text is never unscorable
    huge = 2 * (4 * memory.GIB // per_token)
    assert memory.kv_cache_bytes(str(tiny_bos), "float32", huge, "cuda") == per_token * (huge + 256)
    s = EngineSettings()
    assert memory.engine_bytes("vllm", str(tiny_bos), "float32", "cuda", 256, s) > memory.engine_bytes(
        "vllm", str(tiny_bos), "float32", "cuda", 256, dataclasses.replace(s, tensor_parallel_size=2)
    )


def test_free_bytes_on_cpu_is_the_kernels_available_memory():
    assert 0 < memory.free_bytes("cpu") < 1 << 50


def test_plan_on_cpu_is_one_process_and_refuses_parallel_knobs(tiny_bos):
    s = parallel.resolve(EngineSettings(), str(tiny_bos), "float32", "cpu")
    assert (s.tensor_parallel_size, s.pipeline_parallel_size, s.hf_device_map) == (1, 1, None)
    for bad in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"hf_device_map": "auto"}):
        with pytest.raises(UserError, match="need GPUs"):
            parallel.resolve(EngineSettings(**bad), str(tiny_bos), "float32", "cpu")


def test_plan_picks_the_fewest_gpus_that_hold_the_weights(tiny_bos, monkeypatch):
    path = str(tiny_bos)
    assert parallel.resolve(EngineSettings(), path, "bfloat16", "cuda", [H200]).tensor_parallel_size == 1
    monkeypatch.setattr(memory, "text_config", lambda p, trc: type("Cfg", (), {"num_attention_heads": 32})())
    four = [dataclasses.replace(H200, index=i) for i in range(4)]
    # pretend the weights are 150 GiB in bfloat16 (a 75B model): two H200s hold them, HF spreads out
    monkeypatch.setattr(memory, "weight_bytes", lambda p, d: 150 * memory.GIB * memory.ELEM_BYTES[d] // 2)
    s = parallel.resolve(EngineSettings(), path, "bfloat16", "cuda", four)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size, s.hf_device_map) == (2, 1, "auto")
    assert parallel.resolve(EngineSettings(), path, "float32", "cuda", four).tensor_parallel_size == 4
    # what the user sets is kept; impossible requests are refused with the numbers
    assert parallel.resolve(EngineSettings(tensor_parallel_size=4), path, "bfloat16", "cuda", four).tensor_parallel_size == 4
    with pytest.raises(UserError, match="1 GPU"):
        parallel.resolve(EngineSettings(), path, "bfloat16", "cuda", [H200])
    with pytest.raises(UserError, match="8, but 4 GPU"):
        parallel.resolve(EngineSettings(tensor_parallel_size=8), path, "bfloat16", "cuda", four)
    with pytest.raises(UserError, match="positive integer"):
        parallel.resolve(EngineSettings(tensor_parallel_size=0), path, "bfloat16", "cuda", four)


def test_plan_respects_attention_heads(tiny_bos, monkeypatch):
    """Tensor parallel sizes must divide the attention heads: 12 heads allow 4 GPUs but not 8."""
    eight = [dataclasses.replace(H200, index=i) for i in range(8)]
    monkeypatch.setattr(memory, "text_config", lambda p, trc: type("Cfg", (), {"num_attention_heads": 12})())
    monkeypatch.setattr(memory, "weight_bytes", lambda p, d: 250 * memory.GIB)  # 3 cards' worth: 4 is the next size
    assert parallel.resolve(EngineSettings(), str(tiny_bos), "bfloat16", "cuda", eight).tensor_parallel_size == 4
    monkeypatch.setattr(memory, "weight_bytes", lambda p, d: 450 * memory.GIB)  # needs 8, 12 heads do not split 8 ways
    with pytest.raises(UserError, match="cannot hold them"):
        parallel.resolve(EngineSettings(), str(tiny_bos), "bfloat16", "cuda", eight)


def test_hfs_host_copy_needs_its_own_size_when_vllm_already_sleeps_and_twice_that_while_vllm_holds_the_card():
    """The 30B-A3B shape on a 125 GiB host (46 GB of weights): with vLLM asleep (its weights already in
    host memory, about 74 GB free) HF's pinned copy fits; with vLLM awake on the card, the same free
    memory must also hold vLLM's coming sleep, so it does not, and the copy waits for HF's first sleep."""
    from logprob_parity.engines.hostcopy import fits

    gb = 10**9
    asleep, awake = 1 * gb, 55 * gb  # what other processes hold on the card: vLLM's context, or vLLM itself
    assert fits(46 * gb, 74 * gb, asleep)
    assert not fits(46 * gb, 74 * gb, awake)
    assert fits(46 * gb, 102 * gb, awake)
    assert not fits(46 * gb, 50 * gb, asleep)  # no margin left for the process itself
