"""Where in the network the engines part (logprob_parity.analysis.layers).

Fast tests: the profile's arithmetic and words on planted folders (no engine). Engine tests: the real
HF and vLLM engines of the tiny Llama and Gemma 2 on real ids, with a fault planted in one engine's
weights through the same in-engine access the capture uses, HF forced to SDPA on Gemma 2 (which drops
its attention soft-cap), and the null (HF against itself in vLLM's place); the tiny DeepSeek-V2 the matrix leaves out. The family matrix's test
(tests/test_families.py) checks that every family's layers line up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from logprob_parity.analysis import layers as L

T, H, N_LAYERS = 12, 16, 3


def _write(folder, arrays):
    """arrays: {(block, layer): [T, H]} written as one piece each, as a hook writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    for (block, layer), a in arrays.items():
        np.save(folder / f"{block}.{layer:04d}.0000.npy", np.asarray(a, np.float32))


def _planted(tmp_path, fault=None, scale=1e-2, noise=1e-6, seed=0):
    """HF's rows random; its two noise variations and the float64 reference within `noise` of them;
    vLLM within a quarter of that, and off by `scale` from `fault` = (layer, block, first
    token) on, carried into every later block as a real fault would be."""
    rng = np.random.default_rng(seed)
    base = {(b, layer): rng.normal(size=(T, H)) for layer in range(N_LAYERS) for b in L.BLOCKS}
    order = [(layer, b) for layer in range(N_LAYERS) for b in L.BLOCKS]
    sides = {}
    for side in ("hf", "batched", "chunked", "ref", "vllm"):
        arrays = {}
        for k, (layer, b) in enumerate(order):
            # vLLM's own rounding a quarter of HF's variations': within HF's floor where no fault is
            a = base[(b, layer)] * (1 + (noise / 4 if side == "vllm" else noise) * rng.normal(size=(T, H)))
            if side == "ref":
                a = base[(b, layer)].copy()
            if side == "vllm" and fault is not None and k >= order.index((fault[0], fault[1])):
                a = a.copy()
                a[fault[2] :] += scale * np.linalg.norm(a[fault[2] :], axis=1, keepdims=True) * rng.normal(size=(T - fault[2], H))
            arrays[(b, layer)] = a
        _write(tmp_path / side, arrays)
        sides[side] = {"layers": N_LAYERS, "n_tokens": T, "moe_layers": [1, 2]}
    return sides


def test_relative_error_is_zero_for_equal_rows_and_infinite_where_only_the_reference_row_is_zero():
    a = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0], [1.0, 0.0]])
    b = np.array([[1.0, 2.0], [0.0, 0.0], [0.0, 5.0], [0.0, 0.0]])
    got = L.relative_error(a, b)
    assert got[0] == 0 and got[1] == 0 and got[3] == np.inf
    assert got[2] == pytest.approx(np.linalg.norm([3.0, -1.0]) / 5.0)


def test_the_floor_is_the_noise_tail_and_never_below_the_dtype_rounding():
    assert L.floor_of(np.zeros(10), "bfloat16") == 2.0**-8
    assert L.floor_of(np.array([1e-3, 2e-3, 5e-3]), "float32") == 5e-3  # under 400 tokens: the largest
    many = np.linspace(0, 1, 1000)
    assert L.floor_of(many, "float32") == float(np.quantile(many, 0.995, method="higher"))


def test_the_profile_names_the_layer_block_and_tokens_where_a_planted_fault_starts(tmp_path):
    sides = _planted(tmp_path, fault=(1, "mlp", 3))
    p = L.profile(str(tmp_path), sides, "float32")
    assert (p["parted"]["layer"], p["parted"]["block"]) == (1, "mlp")
    assert p["parted"]["tokens"] == list(range(3, T))
    assert p["parted"]["leaves_reference"] == "HF"  # HF is the closer: vLLM is the one that leaves float64
    assert "first part in layer 1's MoE block (every token from the 4th" in p["words"]
    assert "vLLM is the one that leaves float64 there" in p["words"]
    # every block before the fault is within HF's own floor; the fault's tokens are beyond it from there on
    rows = {(r["layer"], r["block"]): r for r in p["per_layer"]}
    assert not any(rows[(0, b)]["parts"] for b in L.BLOCKS) and not rows[(1, "attn")]["parts"]
    assert p["first_beyond"][:3] == [None, None, None] and set(p["first_beyond"][3:]) == {p["parted"]["index"]}
    assert json.loads(json.dumps(p)) == p  # stored as it is: JSON, no numpy scalars


def test_the_null_profile_parts_nowhere_and_says_so(tmp_path):
    p = L.profile(str(tmp_path), _planted(tmp_path, fault=None), "float32")
    assert p["parted"] is None and all(not r["parts"] for r in p["per_layer"])
    assert p["words"].startswith("vLLM and HF stay within HF's own noise at every layer")
    # an MoE model routed alike on both sides says so, also where nothing parts
    same = L.profile(str(tmp_path), _planted(tmp_path, fault=None), "float32", {"flips": [], "layers": 2})
    assert same["words"].endswith("Every token was routed to the same experts on both sides.")


def test_routing_flips_land_on_their_decoder_layers_and_the_jumps_there_are_counted(tmp_path):
    sides = _planted(tmp_path, fault=(2, "mlp", 0), scale=0.5)
    # two flips at the MoE layers' second entry (decoder layer 2), where the residual's error jumps
    routing = {"flips": [[4, 1, [0, 1], [0, 2]], [5, 1, [0, 1], [0, 3]]], "layers": 2}
    p = L.profile(str(tmp_path), sides, "float32", routing)
    assert p["routing"]["flips"] == [[4, 2], [5, 2]]
    assert p["routing"]["jump_at_flips"] == 1.0 and p["routing"]["flipped_pairs"] == 2
    assert p["routing"]["jump_elsewhere"] < 1.0
    assert "At 100% of the 2 (token, layer) pairs routed to other experts the residual's error jumps" in p["words"]


def test_layers_that_do_not_line_up_are_refused(tmp_path):
    sides = _planted(tmp_path)
    sides["vllm"] = {**sides["vllm"], "layers": N_LAYERS + 1}
    with pytest.raises(ValueError, match="do not line up"):
        L.profile(str(tmp_path), sides, "float32")


def test_the_heat_map_frame_marks_beyond_and_flipped_cells(tmp_path):
    from logprob_parity.present.layers_view import heat_frame, line_frame

    p = L.profile(str(tmp_path), _planted(tmp_path, fault=(1, "attn", 0)), "float32", {"flips": [[2, 0, [1], [2]]]})
    df = heat_frame(p, "resid", pieces=[f"t{i}" for i in range(T)])
    assert len(df) == N_LAYERS * T and df["beyond"][df["layer"] >= 1].all()
    assert not df["beyond"][df["layer"] == 0].any()
    assert df[df["flipped"]][["layer", "token"]].values.tolist() == [[1, 2]]
    lines = line_frame(p)
    assert set(lines["series"]) == {
        "vLLM against float64",
        "HF against float64",
        "vLLM against HF",
        "HF against itself (its floor)",
    }


# --- the real engines ---

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun, and then it rains."


def _hosts(path, dtype="float32", hf_settings=None, null=False, mml=128):
    """Requests for vLLM (or HF itself in its place), HF, and HF float64 eager on the CPU."""
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.spec import EngineSettings

    hf_s = hf_settings or EngineSettings()
    return {
        "vllm": LoadRequest("hf_null" if null else "vllm", str(path), dtype, "cpu", EngineSettings(), mml),
        "hf": LoadRequest("hf", str(path), dtype, "cpu", hf_s, mml),
        "ref": LoadRequest("hf", str(path), "float64", "cpu", EngineSettings(attn_implementation="eager"), mml),
    }


def _profile(path, planted=None, **kw):
    """The layer part on the real engines, with `planted` = (side, layer, block, factor) scaling one
    block's output in one engine for the part's duration (what scaling its output projection's weights
    does; removed after)."""
    from transformers import AutoTokenizer

    from logprob_parity.engines.pool import POOL

    ids = AutoTokenizer.from_pretrained(path)(TEXT)["input_ids"]
    others = [ids[:7], ids[:20]]
    reqs = _hosts(path, **kw)
    with POOL.lease(list(reqs.values())) as lease:
        hosts = {k: lease.host(r) for k, r in reqs.items()}
        if planted:
            assert hosts[planted[0]].call("perturb", *planted[1:]) > 0
        try:
            return L.layer_part(hosts, ids, others, reqs["hf"].dtype, None)
        finally:
            if planted:
                hosts[planted[0]].call("restore")


@pytest.mark.engine
def test_a_fault_planted_in_vllms_layer_1_mlp_is_named_there_and_vllm_leaves_float64(tiny_bos):
    p = _profile(tiny_bos, planted=("vllm", 1, "mlp", 1.05))
    print("PLANTED vLLM layer 1 MLP x1.05:", p["words"])
    assert (p["parted"]["layer"], p["parted"]["block"]) == (1, "mlp"), p["words"]
    assert p["parted"]["tokens"] == list(range(p["n_tokens"])) and p["parted"]["leaves_reference"] == "HF"
    assert "vLLM is the one that leaves float64 there" in p["words"]
    assert p["vllm_record"]["eager"] is True
    # restored: the same engines now stay within HF's noise at that block
    again = _profile(tiny_bos)
    assert not any(r["parts"] for r in again["per_layer"] if (r["layer"], r["block"]) == (1, "mlp")), again["words"]


@pytest.mark.engine
def test_a_fault_planted_in_hfs_layer_0_attention_is_named_there_and_hf_leaves_float64(tiny_bos):
    p = _profile(tiny_bos, planted=("hf", 0, "attn", 0.97))
    print("PLANTED HF layer 0 attention x0.97:", p["words"])
    assert (p["parted"]["layer"], p["parted"]["block"]) == (0, "attn"), p["words"]
    assert "HF is the one that leaves float64 there" in p["words"]


@pytest.mark.engine
def test_hf_against_itself_in_vllms_place_parts_at_no_layer(tiny_bos):
    p = _profile(tiny_bos, null=True)
    print("NULL:", p["words"])
    assert p["parted"] is None and p["words"].startswith("vLLM and HF stay within HF's own noise")


@pytest.mark.engine
def test_gemma2_with_hf_on_sdpa_parts_at_layer_0_attention_where_hf_drops_the_soft_cap():
    """HF's SDPA leaves Gemma 2's attention soft-cap out; vLLM and the float64 eager reference apply it."""
    from families import build_family, family

    from logprob_parity.inputs.spec import EngineSettings

    path = build_family(family("gemma2"))
    p = _profile(path, hf_settings=EngineSettings(attn_implementation="sdpa"))
    print("GEMMA2 SDPA:", p["words"])
    assert (p["parted"]["layer"], p["parted"]["block"]) == (0, "attn"), p["words"]
    assert p["parted"]["leaves_reference"] == "vLLM"  # vLLM is the closer: HF is the one that leaves float64
    assert "HF is the one that leaves float64 there" in p["words"]


@pytest.mark.engine
def test_diagnose_parts_layers_on_the_cli_and_lp_layers_in_python_give_the_same_profile(tiny_bos, tmp_path, capsys, monkeypatch):
    from logprob_parity.cli import main

    monkeypatch.setenv("LOGPROB_PARITY_HOME", str(tmp_path / "home"))
    out = tmp_path / "diag.json"
    rc = main(
        ["diagnose", "--model", str(tiny_bos), "--prompt", TEXT, "--dtype", "float32", "--parts", "layers", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Where in the network (float32, text 1): vLLM and HF" in printed and "== layers ==" in printed
    prof = json.loads(out.read_text())["dtypes"]["float32"]["layers"]
    assert prof["layers"] == 2 and len(prof["per_layer"]) == 2 * len(L.BLOCKS) and prof["text"] == 0
    assert len(prof["vllm_vs_hf"]["resid"][0]) == prof["n_tokens"]
    # the Python API gives the same profile for the same text (its own store)
    import logprob_parity as lp

    api = lp.layers(TEXT, model=str(tiny_bos), dtypes="float32", home=str(tmp_path / "api"), progress=False)["float32"]
    assert api["per_layer"] == prof["per_layer"] and api["words"] == prof["words"]


@pytest.mark.engine
def test_the_tiny_deepseek_v2_gap_is_born_in_layer_0_attention_from_the_4th_token_and_vllm_leaves_float64():
    """The finding docs/concepts/families.md left open: a tiny DeepSeek-V2 on this CPU, 2 to 3 nats apart
    in float32, 0 at the first token and growing from the fourth. The layer part places it: layer 0's
    attention (vLLM's CPU MLA), the first tokens within HF's noise, vLLM the side that leaves float64."""
    from families import DEEPSEEK_V2, build_family

    from logprob_parity.inputs.spec import EngineSettings

    path = build_family(DEEPSEEK_V2)
    p = _profile(path, mml=256, hf_settings=EngineSettings())
    print("DEEPSEEK-V2:", p["words"])
    assert (p["parted"]["layer"], p["parted"]["block"]) == (0, "attn"), p["words"]
    assert p["parted"]["leaves_reference"] == "HF" and "vLLM is the one that leaves float64 there" in p["words"]
    # the first token (one key to attend to): vLLM's MLA agrees with HF's there, within HF's noise
    assert p["vllm_vs_hf"]["attn"][0][0] <= p["per_layer"][0]["floor"]
    first = p["per_layer"][0]
    assert first["vllm_vs_hf_median"] > 1e3 * first["floor"]


def test_the_report_the_terminal_and_the_table_carry_the_layer_part_in_words(tmp_path):
    from logprob_parity.analysis.diagnostics import diagnostics_tables
    from logprob_parity.present.diagnostics_view import diagnostics_text
    from logprob_parity.present.report import diagnostics_section
    from logprob_parity.results.records import DiagnosticsResult, DtypeDiagnosis

    p = L.profile(str(tmp_path), _planted(tmp_path, fault=(2, "attn", 0)), "bfloat16")
    p["words"] += " <script>alert(1)</script>"  # the report escapes what it is given
    d = DtypeDiagnosis(run_id="r", gap={"mean": 0.0, "max": 0.0}, verdict={}, layers={"text": 0, **p})
    diag = DiagnosticsResult("d", "m", "cpu", {}, ("t",), ("layers",), {"bfloat16": "r"}, {"bfloat16": d})
    assert DiagnosticsResult.from_dict(json.loads(json.dumps(diag.to_dict()))).dtypes["bfloat16"].layers == d.layers
    rows = diagnostics_tables(diag)["layers"]
    assert len(rows) == N_LAYERS * len(L.BLOCKS) and [r["parts"] for r in rows].index(True) == 2 * 3
    assert "Where in the network (bfloat16, text 1): vLLM and HF first part in layer 2's attention" in diagnostics_text(diag)
    html = diagnostics_section(diag)
    assert "first part in layer 2&#x27;s attention" in html and "<script>" not in html
    frame = diag.layers_frame()  # what `diagnose --parquet` writes: a row per dtype, layer, block and token
    assert len(frame) == N_LAYERS * len(L.BLOCKS) * T
    at = frame[(frame.layer == 2) & (frame.block == "attn")]
    assert at["beyond"].all() and (at["relative_error"] > at["floor"]).all()


def test_two_profiles_side_by_side_say_where_each_first_parts_and_where_the_error_moved_most(tmp_path):
    a = L.profile(str(tmp_path / "a"), _planted(tmp_path / "a", fault=None), "float32")
    b = L.profile(str(tmp_path / "b"), _planted(tmp_path / "b", fault=(1, "mlp", 0)), "float32")
    d = L.layer_diff(a, b)
    assert d["words"].startswith("A first parts nowhere, B layer 1's MoE block; the median error moved most at layer ")
    assert [r["parts_b"] for r in d["rows"]].index(True) == 4 and not any(r["parts_a"] for r in d["rows"])
    assert "other texts or models" in L.layer_diff(a, {**b, "n_tokens": T + 1})["why"]


def test_the_capture_hooks_come_off_after_a_capture_and_a_planted_fault_comes_off_bit_for_bit(tiny_bos, tmp_path):
    """In one process, HF's own model: after a capture no hook is left on any module (a hook left on a
    model that hf_compile compiles would break its graph), and removing a planted fault gives back the
    same logits to the last bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from logprob_parity.engines import layers as lay

    model = AutoModelForCausalLM.from_pretrained(tiny_bos, dtype=torch.float32).eval()
    x = torch.tensor([[0, 5, 9, 22, 31]])
    with torch.inference_mode():
        before = model(input_ids=x).logits
        assert lay.install_hooks(model) == 2
        lay.begin(str(tmp_path), lambda t: t.reshape(-1, t.shape[-1]))
        model(input_ids=x)
        counts = lay.end(model)
        assert counts == {"attn": 2, "mlp": 2, "resid": 2}
        assert not any(m._forward_hooks for m in model.modules())
        assert lay.read(str(tmp_path), "resid", 1, 5).shape == (5, 64)
        lay.perturb_module(model, 1, "mlp", 1.5)
        moved = model(input_ids=x).logits
        lay.restore_module(model)
        after = model(input_ids=x).logits
    assert not torch.equal(moved, before) and torch.equal(after, before)
    assert not any(m._forward_hooks for m in model.modules())
