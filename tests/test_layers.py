"""Where in the network the engines part (logprob_parity.analysis.layers).

Fast tests: the sinks' comparisons and the profile's arithmetic and words on planted stacks (no engine). Engine tests: the real
HF and vLLM engines of the tiny Llama and Gemma 2 on real ids, with a fault planted in one engine's
weights through the same in-engine access the capture uses, HF forced to SDPA on Gemma 2 (which drops
its attention soft-cap), and the null (HF against itself in vLLM's place); the tiny DeepSeek-V2 the matrix leaves out. The family matrix's test
(tests/test_families.py) checks that every family's layers line up.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from logprob_parity.analysis import layers as L

T, H, N_LAYERS = 12, 16, 3


def _feed(sink, stack, pieces=2):
    """Send a side's [layers, blocks, T, H] stack through `sink` as hooks do: layer by layer, block by
    block, the text in `pieces` forwards (a chunked prefill)."""
    import torch

    bounds = np.linspace(0, T, pieces + 1).astype(int)
    for lo, hi in itertools.pairwise(bounds):
        for layer in range(N_LAYERS):
            for b, block in enumerate(L.BLOCKS):
                sink.put(block, layer, torch.as_tensor(stack[layer, b, lo:hi]))


def _planted(fault=None, scale=1e-2, noise=1e-6, seed=0):
    """HF's rows random; its three noise variations and the float64 reference within `noise` of them;
    vLLM within a quarter of that, and off by `scale` from `fault` = (layer, block, first token) on,
    carried into every later block as a real fault would be. Compared through the same sinks the HF
    host's layer_errors uses; the result is what it returns."""
    import torch

    from logprob_parity.engines import layers as lay

    rng = np.random.default_rng(seed)
    base = rng.normal(size=(N_LAYERS, len(L.BLOCKS), T, H))
    order = [(layer, b) for layer in range(N_LAYERS) for b in L.BLOCKS]
    stacks = {}
    for side in ("vllm", "hf", "batched", "packed", "chunked", "ref"):
        # vLLM's own rounding a quarter of HF's variations': within HF's floor where no fault is
        a = base * (1 + (noise / 4 if side == "vllm" else noise) * rng.normal(size=base.shape))
        if side == "ref":
            a = base.copy()
        if side == "vllm" and fault is not None:
            for k, (layer, b) in enumerate(order):
                if k >= order.index((fault[0], fault[1])):
                    x = a[layer, L.BLOCKS.index(b), fault[2] :]
                    x += scale * np.linalg.norm(x, axis=1, keepdims=True) * rng.normal(size=x.shape)
        stacks[side] = a.astype(np.float32) if side != "ref" else a
    v = torch.as_tensor(stacks["vllm"])
    hf = lay.Sink(N_LAYERS, T, keep=True, against=(("vllm_vs_hf", v, True),))
    _feed(hf, stacks["hf"])
    sinks = [hf]
    for variation in ("batched", "packed", "chunked"):
        sinks.append(lay.Sink(N_LAYERS, T, against=((variation, hf.stack, False),)))
        _feed(sinks[-1], stacks[variation], pieces=3)
    sinks.append(lay.Sink(N_LAYERS, T, against=(("vllm_vs_ref", v, True), ("hf_vs_ref", hf.stack, True))))
    _feed(sinks[-1], stacks["ref"])
    assert not any(s.missing() for s in sinks)
    errors = {k: e for s in sinks for k, e in s.arrays().items()}
    return {"layers": N_LAYERS, "n_tokens": T, "moe_layers": [1, 2], "errors": errors, "vllm": {"eager": True}, "skipped": {}}


def test_relative_error_is_zero_for_equal_rows_and_infinite_where_only_the_reference_row_is_zero():
    import torch

    from logprob_parity.engines import layers as lay

    a = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0], [1.0, 0.0]])
    b = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 5.0], [0.0, 0.0]], dtype=torch.float64)
    got = lay.relative_error(a, b)
    assert got.dtype == torch.float64
    assert got[0] == 0 and got[1] == 0 and got[3] == float("inf")
    assert float(got[2]) == pytest.approx(np.linalg.norm([3.0, -1.0]) / 5.0)


def test_a_sink_fed_in_pieces_compares_each_row_with_the_same_token_of_the_kept_stack():
    """A text prefilled in several forwards arrives in pieces: each lands at its own tokens, the missing
    ones are named, and a stack kept in one process opens in another's place bit for bit."""
    import torch

    from logprob_parity.engines import layers as lay

    rng = np.random.default_rng(1)
    kept = lay.Sink(2, 5, keep=True)
    rows = torch.as_tensor(rng.normal(size=(2, 3, 5, 4)), dtype=torch.float32)
    for lo, hi in ((0, 2), (2, 5)):
        for layer in range(2):
            for b, block in enumerate(L.BLOCKS):
                kept.put(block, layer, rows[layer, b, lo:hi])
    assert torch.equal(kept.stack, rows) and not kept.missing() and kept.pieces == 12
    token = lay.keep(kept.stack)
    try:
        opened = lay.open_stack(lay.share(token))
        assert torch.equal(opened, rows)
    finally:
        assert lay.release(token)
    moved = rows.clone()
    moved[1, 2, 3] *= 1.5
    cmp = lay.Sink(2, 5, against=(("x", rows, False),))
    for layer in range(2):
        for b, block in enumerate(L.BLOCKS):
            cmp.put(block, layer, moved[layer, b, :4])  # the last token never arrives
    assert cmp.missing() == [f"layer {n}'s {b}" for n in range(2) for b in L.BLOCKS]
    err = cmp.arrays()["x"]
    assert err.shape == (2, 3, 5) and err[1, 2, 3] == pytest.approx(0.5) and np.count_nonzero(err) == 1


def test_the_floor_is_the_noise_tail_and_never_below_what_rounding_each_side_once_can_put_between_them():
    u = 2.0**-8
    assert L.floor_of(np.zeros(10), "bfloat16") == 2 * u / (1 - u)
    # one vector rounded to bfloat16 down and up (one ulp apart wherever they differ: the most two
    # results correctly rounded from nearby values differ by) is within it
    import torch

    x = torch.randn(4096, dtype=torch.float64)
    lo = x.to(torch.bfloat16).double()
    hi = torch.where(lo < x, torch.nextafter(lo.bfloat16(), torch.tensor(float("inf"), dtype=torch.bfloat16)).double(), lo)
    one = torch.linalg.vector_norm(lo - hi) / torch.linalg.vector_norm(hi)
    assert 0 < float(one) <= L.rounding_bound("bfloat16")
    assert L.floor_of(np.array([1e-3, 2e-3, 5e-3]), "float32") == 5e-3  # under 400 tokens: the largest
    many = np.linspace(0, 1, 1000)
    assert L.floor_of(many, "float32") == float(np.quantile(many, 0.995, method="higher"))


def test_the_profile_names_the_layer_block_and_tokens_where_a_planted_fault_starts():
    p = L.profile(_planted(fault=(1, "mlp", 3)), "float32")
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


def test_the_null_profile_parts_nowhere_and_says_so():
    p = L.profile(_planted(fault=None), "float32")
    assert p["parted"] is None and all(not r["parts"] for r in p["per_layer"])
    assert p["words"].startswith("vLLM and HF stay within HF's own noise at every layer")
    # an MoE model routed alike on both sides says so, also where nothing parts
    same = L.profile(_planted(fault=None), "float32", {"flips": [], "layers": 2})
    assert same["words"].endswith("Every token was routed to the same experts on both sides.")


def test_routing_flips_land_on_their_decoder_layers_and_the_jumps_there_are_counted():
    got = _planted(fault=(2, "mlp", 0), scale=0.5)
    # two flips at the MoE layers' second entry (decoder layer 2), where the residual's error jumps
    routing = {"flips": [[4, 1, [0, 1], [0, 2]], [5, 1, [0, 1], [0, 3]]], "layers": 2}
    p = L.profile(got, "float32", routing)
    assert p["routing"]["flips"] == [[4, 2], [5, 2]]
    assert p["routing"]["jump_at_flips"] == 1.0 and p["routing"]["flipped_pairs"] == 2
    assert p["routing"]["jump_elsewhere"] < 1.0
    assert "At 100% of the 2 (token, layer) pairs routed to other experts the residual's error jumps" in p["words"]


def test_a_variation_the_model_cannot_run_is_left_out_of_the_envelope_and_named():
    got = _planted()
    without = {**got, "errors": {k: e for k, e in got["errors"].items() if k != "packed"}, "skipped": {"packed": "no mask"}}
    p = L.profile(without, "float32")
    assert p["variations"] == ["batched", "chunked"] and p["variations_skipped"] == {"packed": "no mask"}
    assert L.profile(got, "float32")["variations"] == ["batched", "packed", "chunked"]
    with pytest.raises(ValueError, match="lacks vllm_vs_ref"):
        L.profile({**got, "errors": {k: e for k, e in got["errors"].items() if k != "vllm_vs_ref"}}, "float32")


def test_layers_that_do_not_line_up_are_refused():
    with pytest.raises(ValueError, match="do not line up"):
        L.profile({**_planted(), "layers": N_LAYERS + 1}, "float32")


def test_the_heat_map_frame_marks_beyond_and_flipped_cells():
    from logprob_parity.present.layers_view import heat_frame, line_frame

    p = L.profile(_planted(fault=(1, "attn", 0)), "float32", {"flips": [[2, 0, [1], [2]]]})
    df = heat_frame(p, "resid", pieces=[f"t{i}" for i in range(T)])
    assert len(df) == N_LAYERS * T and df["beyond"][df["layer"] >= 1].all()
    assert not df["beyond"][df["layer"] == 0].any()
    assert df[df["flipped"]][["layer", "token"]].values.tolist() == [[1, 2]]
    lines = line_frame(p)
    assert set(lines["series"]) == {
        "vLLM against float64",
        "HF against float64",
        "vLLM against HF",
        "the floor (HF against itself, at least rounding)",
    }


# --- the real engines ---

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun, and then it rains."


def _hosts(path, dtype="float32", hf_settings=None, null=False, mml=128):
    """Requests for vLLM (or HF itself in its place) and HF (which runs the float64 reference itself)."""
    from logprob_parity.engines.records import LoadRequest
    from logprob_parity.inputs.spec import EngineSettings

    hf_s = hf_settings or EngineSettings()
    return {
        "vllm": LoadRequest("hf_null" if null else "vllm", str(path), dtype, "cpu", EngineSettings(), mml),
        "hf": LoadRequest("hf", str(path), dtype, "cpu", hf_s, mml),
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
    assert p["vllm_record"]["eager"] is True and p["variations"] == ["batched", "packed", "chunked"]
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


def test_the_report_the_terminal_and_the_table_carry_the_layer_part_in_words():
    from logprob_parity.analysis.diagnostics import diagnostics_tables
    from logprob_parity.present.diagnostics_view import diagnostics_text
    from logprob_parity.present.report import diagnostics_section
    from logprob_parity.results.records import DiagnosticsResult, DtypeDiagnosis

    p = L.profile(_planted(fault=(2, "attn", 0)), "bfloat16")
    p["words"] += " <script>alert(1)</script>"  # the report escapes what it is given
    d = DtypeDiagnosis(run_id="r", gap={"mean": 0.0, "max": 0.0}, verdict={}, layers={"text": 0, **p})
    diag = DiagnosticsResult("d", "m", "cpu", {}, ("t",), ("layers",), {"bfloat16": "r"}, {"bfloat16": d})
    assert DiagnosticsResult.from_dict(json.loads(json.dumps(diag.to_dict()))).dtypes["bfloat16"].layers == d.layers
    rows = diagnostics_tables(diag)["layers"]
    assert len(rows) == N_LAYERS * len(L.BLOCKS) and [r["parts"] for r in rows].index(True) == 2 * 3
    assert "Where in the network (bfloat16, text 1): vLLM and HF first part in layer 2's attention" in diagnostics_text(diag)
    assert "where rounding to bfloat16 alone can put them 0.0078 apart" in p["words"]  # bfloat16: no HF noise above rounding
    html = diagnostics_section(diag)
    assert "first part in layer 2&#x27;s attention" in html and "<script>" not in html
    frame = diag.layers_frame()  # what `diagnose --parquet` writes: a row per dtype, layer, block and token
    assert len(frame) == N_LAYERS * len(L.BLOCKS) * T
    at = frame[(frame.layer == 2) & (frame.block == "attn")]
    assert at["beyond"].all() and (at["relative_error"] > at["floor"]).all()


def test_two_profiles_side_by_side_say_where_each_first_parts_and_where_the_error_moved_most():
    a = L.profile(_planted(fault=None), "float32")
    b = L.profile(_planted(fault=(1, "mlp", 0)), "float32")
    d = L.layer_diff(a, b)
    assert d["words"].startswith("A first parts nowhere, B layer 1's MoE block; the median error moved most at layer ")
    assert [r["parts_b"] for r in d["rows"]].index(True) == 4 and not any(r["parts_a"] for r in d["rows"])
    assert "other texts or models" in L.layer_diff(a, {**b, "n_tokens": T + 1})["why"]


def test_the_capture_hooks_come_off_after_a_capture_and_a_planted_fault_comes_off_bit_for_bit(tiny_bos):
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
        with lay.capturing(model, lay.Sink(2, 5, keep=True), lambda t: t.reshape(-1, t.shape[-1]), stop=True) as sink:
            model(input_ids=x)  # the last layer's hook ends it: no final norm, no LM head
        assert sink.pieces == 6 and tuple(sink.stack.shape) == (2, 3, 5, 64) and not sink.missing()
        assert not any(m._forward_hooks for m in model.modules())
        lay.perturb_module(model, 1, "mlp", 1.5)
        moved = model(input_ids=x).logits
        lay.restore_module(model)
        after = model(input_ids=x).logits
    assert not torch.equal(moved, before) and torch.equal(after, before)
    assert not any(m._forward_hooks for m in model.modules())


def test_the_float64_reference_one_layer_at_a_time_is_the_model_loaded_in_float64_and_leaves_the_engine_as_it_was(tiny_bos):
    """The reference the layer part uses (HF's own float32 model, each layer cast up for its forward,
    eager attention) equals the checkpoint loaded in float64 with eager attention, at every layer and
    block; a planted fault stays out of it; after it, every weight is the same tensor at the same address
    and the attention setting is as before, so the engine repeats its own results bit for bit, down to
    one token a forward through its KV cache (MKL's small matmuls sum in an order that follows the
    address: weights cast back into new memory moved them by 3e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    from logprob_parity.engines import layers as lay

    model = AutoModelForCausalLM.from_pretrained(tiny_bos, dtype=torch.float32, attn_implementation="sdpa").eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_bos, dtype=torch.float64, attn_implementation="eager").eval()
    weights = {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    x = torch.tensor([[0, 5, 9, 22, 31, 7, 3]])
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731

    def one_token_a_forward():
        past, out = None, []
        for i in range(x.shape[1]):
            r = model(input_ids=x[:, i : i + 1], position_ids=torch.tensor([[i]]), past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(r.logits[0, -1])
        return torch.stack(out)

    with torch.inference_mode():
        before = one_token_a_forward()
        with lay.capturing(ref, lay.Sink(2, 7, keep=True, dtype=torch.float64), flat, stop=True) as want:
            ref(input_ids=x)
        lay.perturb_module(model, 0, "attn", 0.5)
        with (
            lay.float64_layers(model),
            lay.capturing(model, lay.Sink(2, 7, against=(("ref", want.stack, True),)), flat, stop=True) as got,
        ):
            model(inputs_embeds=lay.float64_embeddings(model, x))
        lay.restore_module(model)
        after = one_token_a_forward()
    assert got.dtypes == {torch.float64} and not got.missing()
    assert float(np.max(got.arrays()["ref"])) < 1e-14
    assert model.config._attn_implementation == "sdpa"
    assert all(torch.equal(v, weights[k][0]) and v.data_ptr() == weights[k][1] for k, v in model.state_dict().items())
    assert torch.equal(after, before)
