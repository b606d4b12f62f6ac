"""The family matrix on this CPU: each family's tiny checkpoint (tests/families.py), compared by the
real HF and vLLM engines in float32 on the same ids, with the exact KL and the noise floor.

What each checks: the gap is within vLLM's own tight tolerance; the exact KL was computed; the BOS
policy gave the ids the family's own tokenizer gives (where it adds its BOS) or a BOS the family does
not put itself, said by `bos_added`; for the sliding-window families, a text more than 3x the window
whose later tokens both engines score with the window applied (against HF without the window, vLLM
is far off). The CPU float32 figures are printed for docs/concepts/families.md.
"""

from __future__ import annotations

import numpy as np
import pytest
from families import FAMILIES, REFUSED, WINDOW, build_family, family

import logprob_parity as lp
from logprob_parity.analysis.verdict import VLLM_TEST_TOL, run_verdicts

pytestmark = pytest.mark.engine

TEXT = (
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. "
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
    "Numbers like 3.14159 and 2.71828 appear in mathematics, physics and engineering."
)


@pytest.fixture(scope="module")
def matrix_home(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_each_family_compares_in_both_dtypes_with_the_exact_kl_rolls_out_and_diagnoses(name, matrix_home):
    """float32: within vLLM's own tight tolerance, routing identical on an MoE; bfloat16: a wider gap
    than float32, still with the exact KL; a rollout scored by all three (vLLM decode and prefill, HF),
    within the tolerance in float32; Diagnostics give the comparison's level; the BOS policy gives the
    family tokenizer's own ids."""
    from logprob_parity.analysis.diagnostics import diagnose
    from logprob_parity.analysis.verdict import diagnosis_verdicts
    from logprob_parity.inputs.spec import EngineSettings, RunSpec
    from logprob_parity.results.store import Store

    f = family(name)
    path = build_family(f)
    f32, bf16 = lp.compare(TEXT, model=str(path), dtypes=("float32", "bfloat16"), home=str(matrix_home), progress=False)
    s, b = f32.summary, bf16.summary
    print(
        f"FAMILY {name}: max |Δ| {s['max_abs_delta']:.3e}, mean {s['mean_abs_delta']:.3e}, exact KL {s['kl_full_mean']:.3e}, "
        f"floor {s['hf_noise_mean']:.3e} ({s['noise_set_by']}), {s['n_tokens']} tokens, bos_added {f32.meta.sequences[0].bos_added}; "
        f"bfloat16 mean |Δ| {b['mean_abs_delta']:.3e}, exact KL {b['kl_full_mean']:.3e}, routers flipped {b.get('routing_flip_frac')}"
    )
    assert s["max_abs_delta"] <= VLLM_TEST_TOL[0], (name, s["max_abs_delta"])
    if f.moe:  # float32 on a CPU: the same experts on both sides, at every token and layer
        assert f32.meta.routing["measured"] and s["routing_flip_frac"] == 0 and s["routing_tokens_flipped"] == 0
        assert bf16.meta.routing["measured"] and b["routing_flip_frac"] is not None
    else:  # a dense model shows no routing keys and says why
        assert f32.meta.routing == {"measured": False, "why": "not an MoE model"} and "routing_flip_frac" not in s
    assert s["kl_full_mean"] is not None and s["kl_full_mean"] < 1e-6
    assert b["kl_full_mean"] is not None and b["kl_full_mean"] > s["kl_full_mean"]
    assert b["mean_abs_delta"] > s["mean_abs_delta"]  # bfloat16 rounds both sides differently
    # Gemma 2 soft-caps its attention logits, which HF's default SDPA leaves out: its HF engine runs eager, and says why
    hf_engine = f32.meta.env.hf_engine
    assert hf_engine["attn_implementation"] == ("eager" if name == "gemma2" else "sdpa"), hf_engine
    assert ("attn_implementation_why" in hf_engine) == (name == "gemma2")
    (own,) = run_verdicts([f32])
    assert own.level in ("match", "systematic")
    # the BOS policy against the family's own tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = list(f32.sequences[0].token_ids)
    plain = tok(TEXT)["input_ids"]
    assert f32.meta.sequences[0].bos_added == (f.bos is not None)
    if f.adds_bos or f.bos is None:
        assert ids == plain  # exactly what the family's tokenizer gives
    else:  # a BOS the family's tokenizer does not add itself: the policy's own choice, said by bos_added
        assert ids == [tok.bos_token_id, *plain]
    # a rollout on the same warm engines: vLLM samples, then vLLM prefill and HF rescore its tokens
    rolled = lp.rollout(
        ["The quick brown fox", "Shall I compare"],
        model=str(path),
        dtypes=("float32", "bfloat16"),
        max_tokens=12,
        ignore_eos=True,
        home=str(matrix_home),
        progress=False,
    )
    for ro in rolled:
        assert [len(x.completion_token_ids) for x in ro.samples] == [12, 12], (name, ro.dtype)
        print(
            f"ROLLOUT {name} {ro.dtype}: decode vs HF mean |Δ| {ro.meta.summary['decode_vs_hf']['mean_abs_delta']:.3e}, "
            f"prefill vs HF {ro.meta.summary['prefill_vs_hf']['mean_abs_delta']:.3e}"
        )
    for pair in ("decode_vs_hf", "prefill_vs_hf"):
        assert rolled[0].meta.summary[pair]["max_abs_delta"] <= VLLM_TEST_TOL[0], (name, pair)
    if f.moe:  # float32: the decode's experts are HF's at every completion token, so replay changes nothing
        rt = rolled[0].meta.routing
        assert rt["measured"] and rt["tokens"] == 24 and rt["routing_flip_frac"] == 0
        assert rt["replay"]["mean_abs_delta_after"] == rt["replay"]["mean_abs_delta_before"]
    else:
        assert rolled[0].meta.routing == {"measured": False, "why": "not an MoE model"}
    # Diagnostics (HF's noise floor on every text) on the same ids: the comparison's level
    spec = RunSpec(texts=(TEXT,), model=str(path), dtypes=("float32",), device="cpu", settings=EngineSettings())
    diag = diagnose(spec, store=Store(matrix_home), parts=("noise", "layers"))
    assert diagnosis_verdicts(diag)["float32"].level == own.level, name
    # where in the network: both engines' layers line up, one by one, and in float32 agree to its rounding
    layers = diag.dtypes["float32"].layers
    n_layers = f.kwargs.get("num_hidden_layers") or f.kwargs.get("n_layer")
    assert layers["layers"] == n_layers and len(layers["per_layer"]) == 3 * n_layers, (name, layers.get("why"))
    assert all(r["vllm_vs_hf_median"] < 1e-5 and r["vllm_vs_hf_max"] < 1e-4 for r in layers["per_layer"]), name
    # the float64 reference (HF's own model, each layer cast up in turn) is float32's rounding away from HF
    assert all(r["hf_vs_ref_median"] < 1e-5 for r in layers["per_layer"]), (name, layers["variations_skipped"])
    assert layers["moe_layers"] == (list(range(n_layers)) if f.moe else [])
    if f.moe:  # float32: the same experts at every token and layer, said on the same grid
        assert layers["routing"]["flips"] == [] and "Every token was routed to the same experts" in layers["words"]
    spec_bf16 = RunSpec(texts=(TEXT,), model=str(path), dtypes=("bfloat16",), device="cpu", settings=EngineSettings())
    bf = diagnose(spec_bf16, store=Store(matrix_home), parts=("layers",)).dtypes["bfloat16"].layers
    assert bf["layers"] == n_layers and len(bf["vllm_vs_hf"]["resid"][0]) == bf["n_tokens"] == len(ids), name
    print(f"LAYERS {name} float32: {layers['words']}\nLAYERS {name} bfloat16: {bf['words']}")


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.window])
def test_both_engines_apply_the_sliding_window(name, matrix_home):
    """The text is more than 3x the window. Past the window, vLLM agrees with HF as configured and
    not with HF scoring the same ids with the window taken out: both sides apply it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_family(family(name))
    (run,) = lp.compare(TEXT, model=str(path), dtypes=("float32",), home=str(matrix_home), progress=False)
    ids = list(run.sequences[0].token_ids)
    assert len(ids) > 3 * WINDOW
    cfg = AutoConfig.from_pretrained(path)
    cfg.sliding_window = 100_000  # longer than the text: the window taken out (Gemma's code always builds one)
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    no_window = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double().numpy()
    vllm = np.asarray(run.sequences[0].vllm.logprob[1:])
    hf = np.asarray(run.sequences[0].hf.logprob[1:])
    past = slice(WINDOW + 1, None)
    with_window = np.abs(vllm[past] - hf[past]).max()
    without = np.abs(vllm[past] - no_window[past]).max()
    print(f"WINDOW {name}: past the window, |vLLM - HF| {with_window:.2e}; |vLLM - HF without the window| {without:.2e}")
    assert with_window <= VLLM_TEST_TOL[0] < without


def _recomputed_routes(path, ids):
    """HF's expert sets recomputed in this test from each MoE layer's router weights: the hidden
    states that reach each router, times its weight matrix, top-k, taken with hooks (not from the
    router logits the backend reads)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    seen = []
    hooks = [g.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0].detach()))) for g in gates]
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        rows = [(x.reshape(len(ids), -1).float() @ mod.weight.float().T).topk(k, dim=-1).indices.numpy() for mod, x in seen]
    return np.sort(np.stack(rows, axis=1), axis=-1)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.moe])
def test_moe_routes_on_both_sides_equal_an_independent_recomputation_from_the_router_weights(name, matrix_home):
    from logprob_parity.engines import routing
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.inputs.settings import EngineSettings

    path = build_family(family(name))
    (run,) = lp.compare(TEXT, model=str(path), dtypes=("float32",), home=str(matrix_home), progress=False)
    ids = list(run.sequences[0].token_ids)
    expected = _recomputed_routes(path, ids)
    hf = np.sort(HFBackend(str(path), "float32", "cpu", EngineSettings(), 256).routes([ids])[0], axis=-1)
    assert np.array_equal(hf, expected)
    # vLLM's captured sets are HF's at every token and layer (no flip), so they equal the recomputation too
    r = run.sequences[0].routing
    assert r["layers"] == expected.shape[1] and len(r["flipped"]) == len(ids) and r["flips"] == []
    # and the comparison can tell a flip: one expert changed at one (token, layer)
    other = expected.copy()
    other[3, 1, 0] = (set(range(64)) - set(other[3, 1])).pop()
    got = routing.compare_routes(other[:, :, ::-1], expected)  # the order inside a set does not matter
    assert got["flipped"][3] == 1 and sum(got["flipped"]) == 1 and got["flips"][0][:2] == [3, 1]


def test_bfloat16_routing_flips_show_per_token_in_the_view_the_gate_and_the_diff(matrix_home):
    """On the tiny Qwen3-MoE in bfloat16 some routers pick other experts in vLLM than in HF: the run
    counts them, the token view colours each token by its layers routed differently and its hover
    lists both expert sets, `check` gates on them, and `diff` against float32 shows them."""
    from logprob_parity.analysis.check import Bounds, check
    from logprob_parity.analysis.diff import diff_runs, diff_text
    from logprob_parity.cli import summary_table
    from logprob_parity.present.render import token_view_html

    path = build_family(family("qwen3_moe"))
    f32, bf16 = lp.compare(TEXT, model=str(path), dtypes=("float32", "bfloat16"), home=str(matrix_home), progress=False)
    s, r = bf16.summary, bf16.sequences[0].routing
    assert s["routing_flip_frac"] > 0 and s["routing_tokens_flipped"] > 0
    assert sum(r["flipped"]) == len(r["flips"]) == round(s["routing_flip_frac"] * len(r["flipped"]) * r["layers"])
    html = token_view_html([bf16], 0, "routing_layers_flipped")
    t, layer, v, h = r["flips"][0]
    assert f"DIFFERENT in {r['flipped'][t]} of {r['layers']} MoE layers" in html and f"layer {layer}: vLLM {v}  HF {h}" in html
    assert "routing_flip_frac" in summary_table([f32, bf16])
    assert not check([bf16], Bounds(max_routing_flip_frac=0.0)).passed and check([f32], Bounds(max_routing_flip_frac=0.0)).passed
    d = diff_runs(f32, bf16)
    assert d.routing["routing_flip_frac"] == {"a": 0.0, "b": s["routing_flip_frac"]} and "routers" in diff_text(d)


def test_an_moe_rollout_compares_the_decodes_experts_with_hfs_and_replay_shrinks_the_gap(matrix_home):
    """The rollout path (issue 30, part 3): in bfloat16 vLLM's decode of the tiny Qwen3-MoE picks other
    experts than HF teacher-forced on some steps; each sample keeps its tokens' flipped layers, the
    verdict (CLI, page, report) says it in words, a token's hover lists both expert sets, and HF
    rescored with the decode's experts forced is closer to the decode than plain HF."""
    from logprob_parity.analysis.verdict import routing_reasons
    from logprob_parity.cli import rollout_text
    from logprob_parity.present.rollout_view import _tip, rollout_report_html

    path = build_family(family("qwen3_moe"))
    (ro,) = lp.rollout(
        ["The quick brown fox", "Shall I compare", "Numbers like"],
        model=str(path),
        dtypes=("bfloat16",),
        samples=4,  # 288 decode steps: on an AVX2-only CPU 72 steps had no flip (vLLM's AVX2 MoE kernels), 288 had 1.9%
        max_tokens=24,
        ignore_eos=True,
        home=str(matrix_home),
        progress=False,
    )
    rt = ro.meta.routing
    per = [info["routing"] for info in ro.meta.samples]
    assert rt["measured"] and rt["tokens"] == 288 == sum(len(r["flipped"]) for r in per)
    assert [len(r["flipped"]) for r in per] == [len(x.completion_token_ids) for x in ro.samples]
    assert rt["routing_flip_frac"] > 0, "bfloat16 decode and HF route some token differently on this model"
    flips = sum(sum(r["flipped"]) for r in per)
    assert flips == round(rt["routing_flip_frac"] * rt["tokens"] * rt["layers"])
    rp = rt["replay"]
    print(f"ROLLOUT ROUTING qwen3_moe bfloat16: {rt['routing_flip_frac']:.4f} of routers, replay {rp}")
    assert rp["mean_abs_delta_before"] == ro.meta.summary["decode_vs_hf"]["mean_abs_delta"]
    assert rp["mean_abs_delta_after"] < rp["mean_abs_delta_before"] and 0 < rp["share_removed"] < 1
    words = routing_reasons(rt)
    assert "picked other experts" in words[0] and "removes" in words[1]
    assert words == list(ro.meta.verdict["reasons"][-2:])  # the verdict says it, on the page and in the CLI
    assert all(w in rollout_text(ro) for w in words) and "Routing replay" in rollout_report_html(ro)
    i = next(k for k, r in enumerate(per) if r["flips"])
    t, layer, v, h = per[i]["flips"][0]
    assert f"layer {layer}: vLLM {v}  HF {h}" in _tip(ro, i, t)


def test_routing_replay_with_hfs_own_routes_changes_nothing_and_with_vllms_routes_takes_vllms_experts(matrix_home):
    """R3's rule on HF: forcing HF's own expert choices gives its values bit for bit; forcing vLLM's
    makes every router return vLLM's sets (no flip left), and the gap to vLLM that remains is what
    Diagnostics' setting-by-setting table reports for routing replay."""
    import torch

    from logprob_parity.analysis.diagnostics import REPLAY_KNOB, _replay_row
    from logprob_parity.engines import routing
    from logprob_parity.engines.backends.hf import HFBackend
    from logprob_parity.engines.pool import POOL
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.settings import EngineSettings

    path = build_family(family("qwen3_moe"))
    (run,) = lp.compare(TEXT, model=str(path), dtypes=("bfloat16",), home=str(matrix_home), progress=False)
    ids = list(run.sequences[0].token_ids)
    hf = HFBackend(str(path), "bfloat16", "cpu", EngineSettings(), 256)
    own = hf.routes([ids])[0]
    plain = hf.score([ids], 1)[0].logprob
    assert np.array_equal(hf.replay_score([ids], [own])[0][1:], plain[1:])  # bit for bit
    flips = run.sequences[0].routing["flips"]
    assert flips
    vllm_routes = np.sort(own, axis=-1)
    for t, layer, v, _h in flips:
        vllm_routes[t, layer] = v
    with routing.Replay(hf.model, vllm_routes) as rp, torch.inference_mode():
        hf.model(input_ids=torch.tensor([ids]), use_cache=False)
    assert routing.compare_routes(vllm_routes, np.stack(rp.chosen, axis=1))["flips"] == []
    # the Diagnostics row, on the warm engines of the comparison
    reqs = [
        LoadRequest(b, str(path), "bfloat16", "cpu", EngineSettings(), run.meta.settings["max_model_len"]) for b in ("hf", "vllm")
    ]
    with POOL.lease(reqs) as lease:
        row = _replay_row(run, lease.host(reqs[0]), lease.host(reqs[1]), [ids], [run.sequences[0].vllm.logprob], lambda *a: None)
    base = run.summary["mean_abs_delta"]
    print(f"REPLAY qwen3_moe bfloat16: mean gap {base:.3e} -> {row['mean_abs_delta']:.3e} with vLLM's routes replayed")
    assert row["knob"] == REPLAY_KNOB and row["mean_abs_delta"] < base and row["change"] < 0


def test_a_family_vllm_cannot_run_is_refused_in_words_naming_it_and_nothing_is_stored(tmp_path):
    """CodeGen: transformers runs it, this vLLM has no implementation. The error names the engine,
    the family and the reason in one line (no traceback, not vLLM's list of every architecture), and
    the store stays empty."""
    from logprob_parity.errors import UserError
    from logprob_parity.results.store import Store

    path = build_family(REFUSED)
    with pytest.raises(UserError) as err:
        lp.compare(TEXT, model=str(path), dtypes=("float32",), home=str(tmp_path), progress=False)
    text = str(err.value)
    print("REFUSED", text)
    assert "vllm (float32) cannot run the codegen (CodeGenForCausalLM) family" in text
    assert "does not support this model's architecture" in text and "['CodeGenForCausalLM'] are not supported" in text
    assert "Traceback" not in text and "Supported architectures" not in text and "\n" not in text
    assert Store(tmp_path).list_runs().empty
