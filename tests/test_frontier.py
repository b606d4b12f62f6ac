"""The accuracy–speed frontier: configurations parsed, the Pareto front and the recommendation by
hand, then a real frontier on the demo model (vLLM per configuration, HF float64 reference)."""

import json

import pytest
from conftest import AVX512

from logprob_parity.analysis.frontier import Config, default_grid, frontier, frontier_text, pareto, parse_configs, recommend
from logprob_parity.errors import UserError
from logprob_parity.inputs.spec import RunSpec


def _row(name, gap, speed, skipped=None):
    return {
        "name": name,
        "ref_gap": None if skipped else {"mean": gap, "max": gap, "kl_mean": gap},
        "tokens_per_s": None if skipped else {"prefill": speed, "generate": speed / 10},
        "skipped": skipped,
    }


def test_configurations_parse_from_words_and_bad_ones_say_why():
    got = parse_configs("float32; bfloat16 kv_cache_dtype=fp8 ; float32 enforce_eager=false attention_backend=FLEX_ATTENTION")
    assert [c.name for c in got] == [
        "float32",
        "bfloat16 kv_cache_dtype=fp8",
        "float32 enforce_eager=False attention_backend=FLEX_ATTENTION",
    ]
    assert (
        got[2].settings(__import__("logprob_parity.inputs.settings", fromlist=["EngineSettings"]).EngineSettings()).enforce_eager
        is False
    )
    for bad, words in (
        ("int8", "must start with a dtype"),
        ("float32 warp=9", "known setting"),
        ("float32 kv_cache_dtype=int4", "kv_cache_dtype must be one of"),
        ("float32 enforce_eager=maybe", "true or false"),
        ("  ;  ", "no configuration"),
    ):
        with pytest.raises(UserError, match=words):
            parse_configs(bad)


def test_the_pareto_front_keeps_what_nothing_beats_on_both():
    rows = [
        _row("exact-slow", 1e-6, 10),
        _row("rough-fast", 1e-2, 1000),
        _row("worse-both", 2e-2, 500),
        _row("middle", 1e-4, 100),
        _row("off", None, None, skipped="no GPU"),
    ]
    assert pareto(rows) == ["exact-slow", "rough-fast", "middle"]


def test_the_recommendation_is_the_fastest_within_the_tolerance():
    rows = [_row("exact-slow", 1e-6, 10), _row("rough-fast", 1e-2, 1000), _row("middle", 1e-4, 100)]
    middle = recommend(rows, 1e-3, "given")
    assert middle["name"] == "middle" and "2 of 3 configurations are within it" in middle["why"]
    assert recommend(rows, 1.0, "given")["name"] == "rough-fast"
    alone = recommend(rows, 1e-5, "given")  # the words a person reads when one configuration qualifies
    assert alone["name"] == "exact-slow" and alone["why"].startswith("the only configuration within the tolerance")
    assert alone["why"].endswith("1 of 3 configurations is within it") and "faster than every other" not in alone["why"]
    none = recommend(rows, 1e-9, "given")
    assert none["name"] is None and "exact-slow" in none["why"]
    assert recommend([_row("off", None, None, "no GPU")], 1.0, "given")["name"] is None


def test_a_speed_difference_inside_the_spread_of_the_repeats_does_not_count():
    """Two configurations within the tolerance whose repeats overlap are equally fast: the more
    accurate one is recommended, and the words say why; a lead beyond the spread still wins."""

    def spread(row, lo, hi):
        row["tokens_per_s"].update(prefill_spread=[lo, hi], repeats=3)
        return row

    exact = spread(_row("exact", 1e-6, 950), 900, 1000)
    rough = spread(_row("rough", 1e-4, 990), 960, 1020)
    rec = recommend([exact, rough], 1e-3, "given")
    assert rec["name"] == "exact" and "no faster beyond the spread" in rec["why"] and "rough" in rec["why"]
    far = spread(_row("rough", 1e-4, 2000), 1900, 2100)
    rec = recommend([exact, far], 1e-3, "given")
    assert rec["name"] == "rough" and "by more than the spread" in rec["why"]


def test_the_cpu_grid_lists_what_it_cannot_run_with_the_reason():
    grid = default_grid("cpu")
    skipped = {c.name: c.skip for c in grid if c.skip}
    assert "float32 tf32=True" in skipped and "NVIDIA" in skipped["float32 tf32=True"]
    runnable = {c.name for c in grid if not c.skip}
    assert any("batch_invariant" in n for n in skipped) and {"float16", "bfloat16", "float32"} <= runnable
    # an FP8 KV cache where vLLM's CPU attention has it (AVX-512 or AMX), else listed with vLLM's reason
    assert ("bfloat16 kv_cache_dtype=fp8" in runnable) == AVX512, skipped
    gpu = default_grid("cuda")  # listed here, each with why this machine cannot run it (no CUDA, the CPU build)
    assert len(gpu) >= 10 and all(c.skip for c in gpu if ("tf32", True) in c.changes)
    names = [c.name for c in gpu]
    assert "bfloat16 quantization=fp8" in names and "bfloat16 kv_cache_dtype=fp8" in names
    for g in (grid, gpu):  # listed on both, with the reason it is not measured
        pre = [c for c in g if c.name.startswith("a pre-quantized checkpoint")]
        assert len(pre) == 1 and "checkpoint=PATH" in pre[0].skip


def test_a_pre_quantized_checkpoint_is_refused_with_the_reason(tiny_bos, home, tmp_path):
    """Its float64 reference would need unquantized weights the folder does not hold: refused
    before any engine starts, in words."""
    import json
    import shutil

    from logprob_parity.analysis.request import Context

    model = tmp_path / "tiny-awq"
    shutil.copytree(tiny_bos, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    ctx = Context.of()
    before = len(ctx.pool.running())
    with pytest.raises(UserError, match=r"pre-quantized checkpoint \(awq\).*unquantized model.*checkpoint="):
        frontier(RunSpec(texts=("Hello there.",), model=str(model), device="cpu"), [Config("float32")], ctx)
    assert len(ctx.pool.running()) == before  # refused before any engine started


@pytest.mark.engine
def test_a_frontier_on_the_demo_model_measures_and_recommends(demo_model, home, tmp_path):
    from logprob_parity.analysis.request import Context
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    configs = parse_configs("float32; bfloat16; float16; bfloat16 kv_cache_dtype=fp8")
    spec = RunSpec(
        texts=("The capital of France is Paris, and the capital of Italy is Rome.",), model=str(demo_model), device="cpu"
    )
    store = Store(home)
    result = frontier(spec, configs, Context.of(store=store))
    rows = {c["name"]: c for c in result.configs}
    ran = [c for c in result.configs if not c["skipped"]]
    fp8 = rows["bfloat16 kv_cache_dtype=fp8"]
    if AVX512:
        assert len(ran) == 4, [(c["name"], c["skipped"]) for c in result.configs]
    else:  # listed with vLLM's own reason, asked of the build before any engine started
        assert len(ran) == 3 and fp8["start_s"] is None and fp8["memory"] is None, [
            (c["name"], c["skipped"]) for c in result.configs
        ]
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in fp8["skipped"]
    for c in ran:
        assert c["ref_gap"]["mean"] > 0 and c["ref_gap"]["max"] >= c["ref_gap"]["mean"] and c["ref_gap"]["kl_mean"] is not None
        assert c["hf_ref_gap"]["mean"] > 0 and c["tokens_per_s"]["prefill"] > 0 and c["tokens_per_s"]["generate"] > 0
        tps = c["tokens_per_s"]  # speed on the load, repeated: the median inside the spread
        assert tps["repeats"] == 3 and tps["load"] == "4 x 128 tokens"
        assert tps["prefill_spread"][0] <= tps["prefill"] <= tps["prefill_spread"][1]
        assert c["memory"]["weights_bytes"] > 0 and c["memory"]["kv_bytes_per_token"] > 0
    if AVX512:  # 8-bit keys and values: half of bfloat16's bytes a token, and they cost accuracy
        assert fp8["memory"]["kv_bytes_per_token"] * 2 == rows["bfloat16"]["memory"]["kv_bytes_per_token"]
        assert fp8["ref_gap"]["mean"] > rows["bfloat16"]["ref_gap"]["mean"]
    # twice the bytes, up to the few vectors vLLM's CPU build keeps in float32 beside bfloat16 weights (its
    # norms, on an AVX2 processor): 537,919,488 against 2 x 269,030,016 there
    assert rows["float32"]["memory"]["weights_bytes"] == pytest.approx(2 * rows["bfloat16"]["memory"]["weights_bytes"], rel=1e-3)
    assert result.speed == {"load": "4 x 128 tokens", "repeats": 3, "gen_tokens": 32}
    assert rows["float32"]["ref_gap"]["mean"] < rows["bfloat16"]["ref_gap"]["mean"]
    assert rows["float32"]["ref_gap"]["kl_mean"] < rows["bfloat16"]["ref_gap"]["kl_mean"]
    assert result.recommendation["name"] in rows and result.recommendation["why"]
    assert result.tolerance["value"] == pytest.approx(2 * rows["float32"]["hf_ref_gap"]["mean"])
    # the documented --json shape, and the stored copy reads back the same
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data["recommendation"]) == {"name", "why"}
    for c in data["configs"]:
        assert {"name", "settings", "ref_gap", "hf_ref_gap", "tokens_per_s", "start_s", "skipped"} <= set(c)
        if c["skipped"]:
            continue
        assert set(c["ref_gap"]) == {"mean", "max", "kl_mean"}
        assert set(c["tokens_per_s"]) == {"prefill", "generate", "prefill_spread", "generate_spread", "repeats", "load"}
    assert store.load_frontier(result.frontier_id).to_dict() == data
    text = frontier_text(result)
    assert "recommendation:" in text and "float32" in text


@pytest.mark.engine
def test_frontier_cli_writes_json_and_a_bad_configuration_exits_2(demo_model, home, tmp_path, capsys):
    from logprob_parity.cli import main

    out = tmp_path / "f.json"
    rc = main(
        [
            "frontier",
            "--model",
            str(demo_model),
            "--prompt",
            "Hello there, general.",
            "--device",
            "cpu",
            "--configs",
            "float32; bfloat16",
            "--tolerance",
            "1",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [c["name"] for c in data["configs"]] == ["float32", "bfloat16"] and data["tolerance"]["source"] == "given"
    # both are within a tolerance of 1: the faster beyond the spread of the repeats, or, where the two
    # spreads overlap, the more accurate (frontier.recommend); on this CPU both happen, run to run
    fast, slow = sorted(data["configs"], key=lambda c: -c["tokens_per_s"]["prefill"])
    overlap = slow["tokens_per_s"]["prefill_spread"][1] >= fast["tokens_per_s"]["prefill_spread"][0]
    expected = min(data["configs"], key=lambda c: c["ref_gap"]["mean"]) if overlap else fast
    rec = data["recommendation"]
    assert rec["name"] == expected["name"], (rec, [(c["name"], c["tokens_per_s"], c["ref_gap"]) for c in data["configs"]])
    assert ("no faster beyond the spread" in rec["why"]) == overlap, rec["why"]
    rc = main(["frontier", "--model", str(demo_model), "--prompt", "x y z", "--configs", "float32 warp=9"])
    assert rc == 2 and "known setting" in capsys.readouterr().err


def test_a_configuration_keeps_its_settings_apart_from_the_base():
    from logprob_parity.inputs.settings import EngineSettings

    c = Config("bfloat16", (("kv_cache_dtype", "fp8"),))
    s = c.settings(EngineSettings(seed=3))
    assert s.kv_cache_dtype == "fp8" and s.seed == 3 and c.name == "bfloat16 kv_cache_dtype=fp8"


def test_a_stored_frontier_shows_and_reports_as_html_and_json_with_its_text_escaped(home, tmp_path, capsys):
    """`show` and `report` take a frontier id as they take a run's. The HTML page opens offline,
    names the recommendation and what did not run, and escapes every text (a configuration's
    failure message is engine output, the texts are the user's)."""
    from test_dashboard import make_frontier

    from logprob_parity.cli import main
    from logprob_parity.results.store import Store

    Store(home).save_frontier(make_frontier("fee321"))
    assert main(["runs"]) == 0  # listed with the runs, rollouts and diagnostics
    listed = capsys.readouterr().out
    assert "frontiers:" in listed and "fee321" in listed
    assert main(["show", "fee3"]) == 0
    shown = capsys.readouterr().out
    assert "recommendation: float32" in shown and "bfloat16 quantization=fp8  skipped: vLLM could not start it" in shown
    page = tmp_path / "f.html"
    assert main(["report", "fee3", "-o", str(page)]) == 0
    doc = page.read_text(encoding="utf-8")
    assert "<b>Recommended: float32.</b>" in doc and "Hi 🌊 مرحبا" in doc
    assert "&lt;b&gt;no fp8 kernel&lt;/b&gt;" in doc and "<b>no fp8 kernel</b>" not in doc
    assert "<svg" in doc  # the scatter, drawn inline
    for name in ("float32", "bfloat16", "bfloat16 kv_cache_dtype=fp8"):
        assert f"<td class=l>{name}</td>" in doc
    assert main(["report", "fee3", "-o", str(tmp_path / "f.json")]) == 0
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["recommendation"]["name"] == "float32" and len(data["configs"]) == 4
    assert main(["report", "fee3", "-o", str(tmp_path / "f.parquet")]) == 2
    assert "must end in .html or .json" in capsys.readouterr().err


def test_configurations_start_in_groups_that_fit_the_pool():
    """Engines of as many configurations as fit (here: a pool capped at 5 engines) start side by
    side; the next configuration opens a new group. Engines two configurations share (HF in one
    dtype, the float64 reference) count once."""
    from types import SimpleNamespace

    from logprob_parity.analysis.frontier import _engines, _groups
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.settings import EngineSettings

    class Pool:
        def fits_together(self, requests):
            return len({r.key() for r in requests}) <= 5

    p = SimpleNamespace(
        ctx=SimpleNamespace(pool=Pool()),
        model=SimpleNamespace(path="/m"),
        device="cpu",
        spec=SimpleNamespace(settings=EngineSettings()),
        max_model_len=256,
    )
    ref = LoadRequest("hf", "/m", "float64", "cpu", EngineSettings(), 256)
    configs = parse_configs("float32; bfloat16; float32 enable_prefix_caching=true; bfloat16 kv_cache_dtype=fp8; float16")
    groups = _groups(p, list(enumerate(configs)), ref)
    assert [[k for k, _ in g] for g in groups] == [[0, 1], [2, 3], [4]]
    # float32 + bfloat16: two vLLM, two HF, the reference; prefix caching is vLLM's alone, so HF float32 is shared
    assert len(_engines(p, [configs[0], configs[2]], ref)) == 4


@pytest.mark.engine
def test_a_pre_quantized_checkpoint_is_measured_against_the_model_it_quantizes(tiny_bos, tiny_gptq, home, monkeypatch):
    """'bfloat16 checkpoint=PATH': vLLM loads a GPTQ 4-bit checkpoint of the tiny model (built here
    by hand) and is scored on the model's ids against the model itself in float64. Its gap must be
    what 4-bit weights make, checked independently: HF in float64 on the dequantized 4-bit weights
    against HF in float64 on the model, the same ids. On a processor without AVX-512, where vLLM's CPU
    build has no 4-bit kernel, the configuration is listed with that reason instead, found before its
    engine starts or, where the build's check missed it, at its first forward."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logprob_parity.analysis.request import Context

    gptq, dequantized = tiny_gptq
    text = "The quick brown fox jumps over the lazy dog, twice."
    name = f"bfloat16 checkpoint={gptq}"
    result = frontier(
        RunSpec(texts=(text,), model=str(tiny_bos), device="cpu"), parse_configs(f"bfloat16; {name}"), Context.of(), tolerance=1.0
    )
    rows = {c["name"]: c for c in result.configs}
    q = rows[name]
    assert not rows["bfloat16"]["skipped"] and rows["bfloat16"]["ref_gap"]["mean"] > 0
    if not AVX512:  # vLLM's AVX2 kernels have no 4-bit GEMM: listed with the reason before its engine starts
        assert q["start_s"] is None and q["ref_gap"] is None, q
        assert q["skipped"].startswith("vLLM cannot run this gptq checkpoint here") and "cpu_gemm_wna16" in q["skipped"], q
        # and where the build's check did not know it, the engine loads, fails at its first forward, and the
        # frontier still measures the rest, listing this one with vLLM's error
        from logprob_parity.engines import build

        known = build.unsupported()
        monkeypatch.setattr(build, "unsupported", lambda: {k: v for k, v in known.items() if k != ("quant_method", "gptq")})
        again = frontier(
            RunSpec(texts=(text,), model=str(tiny_bos), device="cpu"),
            parse_configs(f"bfloat16; {name}"),
            Context.of(),
            tolerance=1.0,
        )
        rows = {c["name"]: c for c in again.configs}
        assert rows[name]["skipped"].startswith("vLLM could not run it: vllm (bfloat16)") and rows[name]["ref_gap"] is None, rows
        assert "cpu_gemm_wna16" in rows[name]["skipped"] and rows[name]["start_s"] is not None
        assert not rows["bfloat16"]["skipped"] and rows["bfloat16"]["ref_gap"]["mean"] > 0
        return
    assert not q["skipped"] and q["ref_gap"]["kl_mean"] is not None and q["tokens_per_s"]["prefill"] > 0, q

    ids = torch.tensor([AutoTokenizer.from_pretrained(str(tiny_bos))(text)["input_ids"]])

    def logprobs(folder):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()
        with torch.inference_mode():
            lp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        return lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].numpy()

    want = float(np.mean(np.abs(logprobs(dequantized) - logprobs(tiny_bos))))
    assert want > 10 * rows["bfloat16"]["ref_gap"]["mean"]  # 4 bits move this model far more than bfloat16 rounding
    # vLLM runs the 4-bit weights with bfloat16 activations: the gap is the 4-bit one, up to bfloat16's
    assert abs(q["ref_gap"]["mean"] - want) <= 0.25 * want + 2 * rows["bfloat16"]["ref_gap"]["mean"], (q["ref_gap"], want)
    assert rows["bfloat16"]["ref_gap"]["mean"] < q["ref_gap"]["mean"]


def test_a_checkpoint_outside_the_servers_model_roots_is_refused(tiny_bos, tiny_gptq, home):
    """A configuration's checkpoint is a model folder like any other: the same model-root rules."""
    from logprob_parity.analysis.request import Context

    gptq, _ = tiny_gptq
    ctx = Context.of(model_roots=[str(tiny_bos)])
    before = len(ctx.pool.running())
    with pytest.raises(UserError) as err:
        frontier(
            RunSpec(texts=("Hello there.",), model=str(tiny_bos), device="cpu"), parse_configs(f"bfloat16 checkpoint={gptq}"), ctx
        )
    assert str(gptq) in str(err.value) or "allowed" in str(err.value)
    assert len(ctx.pool.running()) == before  # refused before any engine started


def test_speed_is_never_read_from_one_timing_and_the_pages_default_times_each_configuration_three_times(tiny_bos):
    """Issue 40: one timing read float32 31x behind bfloat16 with a 'spread' of one value."""
    from logprob_parity.analysis.estimate import frontier_defaults
    from logprob_parity.analysis.frontier import frontier
    from logprob_parity.errors import UserError
    from logprob_parity.inputs.spec import RunSpec

    for device in ("cpu", "cuda"):
        assert frontier_defaults(device, ["float32", "bfloat16"]).repeats >= 3
    with pytest.raises(UserError, match="at least 3 timed repeats"):
        frontier(RunSpec(texts=("x",), model=str(tiny_bos)), repeats=1)
