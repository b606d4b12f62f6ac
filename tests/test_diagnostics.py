"""Each diagnostic on the real engines: the demo model on the CPU, and the knob ablation on a tiny model."""

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
from test_dashboard import APP

from logprob_parity.analysis.diagnostics import diagnose, knob_lines
from logprob_parity.inputs.spec import RunSpec
from logprob_parity.present.diagnostics_view import diagnostics_text
from logprob_parity.results.store import Store

pytestmark = pytest.mark.engine

SEED = "Dave lives in Palm Coast, FL and is a lawyer. His personal interests include playing guitar, hiking, and spending time with his family."


@pytest.fixture(scope="module")
def demo_diag(demo_model, tmp_path_factory):
    home = tmp_path_factory.mktemp("diag-home")
    (home / "models").symlink_to(demo_model.parent)
    store = Store(home)
    spec = RunSpec(texts=(SEED,), model=None, dtypes=("float32", "bfloat16"), top_k=5)
    return store, diagnose(spec, store=store, parts=("noise", "reference", "downstream"))


def test_noise_floor(demo_diag):
    _, r = demo_diag
    f32, bf16 = r.dtypes["float32"], r.dtypes["bfloat16"]
    for out in (f32, bf16):
        assert set(out.noise) == {
            "micro_batch",
            "padding_side",
            "packed",
            "chunked_kv",
            "envelope",
            "vllm_alone_vs_batched",
            "vllm_repeat",
            "hf_attn_eager",
            "hf_incremental",
        }
        # the floor's variations rest on at least 400 tokens: the text's 29, topped up with bundled texts
        floor_rows = ("micro_batch", "padding_side", "packed", "chunked_kv", "envelope")
        assert all(v["n"] >= 400 for k, v in out.noise.items() if k in floor_rows)
        assert all(v["n"] == 29 for k, v in out.noise.items() if k not in floor_rows)
    # the trainer-style rows are in the noise table, in words, and the table says which are the floor
    from logprob_parity.analysis.diagnostics import diagnostics_tables

    rows = diagnostics_tables(r)["noise"]
    whats = {row["what"] for row in rows}
    assert any("one token a forward through its KV cache" in w for w in whats)
    assert any("tokens a forward through its KV cache" in w and row.get("in the floor") for row in rows for w in [row["what"]])
    assert any("packed into one row" in w for w in whats) and any("micro-batch changes from 1 to" in w for w in whats)
    for out in (f32, bf16):
        assert out.floor["hf"] > 0 and out.floor["vllm"] >= 0  # measured, and on this CPU never exactly 0
        # the floor is the largest of the definition's variations, and names it
        key = out.floor["noise_set_by"]
        assert out.floor["hf"] == max(out.noise[k]["mean"] for k in ("micro_batch", "padding_side", "packed", "chunked_kv"))
        assert out.floor["hf"] == out.noise[key]["mean"] and out.floor["noise_words"].startswith("HF moves")
    assert f32.floor["hf"] < 1e-3  # float32 noise is tiny
    assert bf16.gap["mean"] > 10 * f32.gap["mean"]
    print({d: (o.gap["mean"], o.floor, o.ratio_to_hf_noise) for d, o in r.dtypes.items()})


def test_compare_and_diagnostics_give_one_level_and_one_floor_in_float32_and_bfloat16(demo_diag):
    """The default text on the demo model: the comparison's own verdict, the same after Diagnostics
    ran, and Diagnostics' verdict are one level per dtype, judged against one floor, the legend's."""
    from logprob_parity.analysis.verdict import diagnosis_verdicts, run_verdicts
    from logprob_parity.dashboard.components.run_view import noise_floors
    from logprob_parity.present.render import token_view_html

    store, r = demo_diag
    runs = [store.load(r.run_ids[d]) for d in ("float32", "bfloat16")]
    before = {x.dtype: v for x, v in zip(runs, run_verdicts(runs))}
    after = {x.dtype: v for x, v in zip(runs, run_verdicts(runs, r))}
    diag = diagnosis_verdicts(r)
    for d in ("float32", "bfloat16"):
        assert before[d].level == after[d].level == diag[d].level, (d, before[d].headline, diag[d].headline)
        run = next(x for x in runs if x.dtype == d)
        assert run.summary["hf_noise_mean"] == r.dtypes[d].floor["hf"]  # one number on both pages
        assert run.summary["noise_set_by"] == r.dtypes[d].floor["noise_set_by"]
        # the verdict names the variation that set the floor
        assert run.summary["noise_words"] in " ".join(before[d].reasons)
    for found in (None, r):  # the legend's noise is the verdict's, before and after Diagnostics
        floors = noise_floors(runs, found)
        html = token_view_html(runs, 0, floors=floors["tail"], floor_words=floors["tail_words"])
        for d in ("float32", "bfloat16"):
            assert floors["hf"][d] == r.dtypes[d].floor["hf"]
            assert (
                floors["tail"][d]
                == r.dtypes[d].floor["hf_noise_tail"]
                == runs[("float32", "bfloat16").index(d)].summary["hf_noise_tail"]
            )
            assert f"{d} ≤ {floors['tail'][d]:.2g}" in html


def test_packed_and_chunked_scoring_move_hf_so_the_floor_is_not_zero(demo_diag):
    """HF against itself on the demo model: packing the texts into one row and scoring through the
    KV cache move its values (batching and padding alone do not on this CPU), so the floor is above 0
    and the verdict names the variation that set it, never "HF's own noise of 0"."""
    from logprob_parity.analysis.verdict import run_verdicts

    store, r = demo_diag
    for d in ("float32", "bfloat16"):
        run = store.load(r.run_ids[d])
        var = run.meta.noise["variations"]
        assert var["packed"]["mean"] > 0 and var["chunked_kv"]["mean"] > 0
        assert run.summary["hf_noise_mean"] > 0 and run.summary["noise_set_by"] in ("packed", "chunked_kv")
        (v,) = run_verdicts([run])
        assert "noise of 0" not in v.headline and run.summary["noise_words"] in " ".join(v.reasons)


def test_reference(demo_diag):
    _, r = demo_diag
    f32, bf16 = r.dtypes["float32"].reference, r.dtypes["bfloat16"].reference
    assert f32["vllm_vs_ref"]["max"] < 1e-3 and f32["hf_vs_ref"]["max"] < 1e-3
    assert bf16["vllm_vs_ref"]["mean"] > 1e-3 and bf16["hf_vs_ref"]["mean"] > 1e-3
    for ref in (f32, bf16):
        assert ref["closer_overall"] in ("vLLM", "HF", "neither")  # the verdict's rule: 2x farther, or neither
        assert ref["frac_tokens_vllm_closer"] is None or 0 <= ref["frac_tokens_vllm_closer"] <= 1
    print({d: o.reference for d, o in r.dtypes.items()})


def test_downstream(demo_diag):
    _, r = demo_diag
    for _d, out in r.dtypes.items():
        g, m = out.greedy, out.mcq
        assert g["n_tokens"] == 16 and g["hf_text"] and g["vllm_text"]
        assert g["first_difference"] is None or (0 <= g["first_difference"] < 16 and g["hf_token"] != g["vllm_token"])
        assert m["n_questions"] == 16 and 0 <= m["flips_between_engines"] <= 16
        assert 0 <= m["hf_accuracy"] <= 1 and 0 <= m["vllm_accuracy"] <= 1
    assert set(r.mcq_dtype_flips) == {"hf bfloat16 vs float32", "vllm bfloat16 vs float32"}
    print({d: (o.greedy["first_difference"], o.mcq) for d, o in r.dtypes.items()}, r.mcq_dtype_flips)


def test_verdict_and_storage(demo_diag):
    store, r = demo_diag
    from logprob_parity.analysis.verdict import SYSTEMATIC_NOISE_RATIO, diagnosis_verdicts

    f32 = r.dtypes["float32"]
    # the stored verdict is the one verdict function's, over the stored evidence
    import json

    stored = {d: o.verdict for d, o in r.dtypes.items()}
    assert stored == json.loads(json.dumps({d: v.to_dict() for d, v in diagnosis_verdicts(r).items()}))
    assert f32.verdict["level"] == ("systematic" if f32.ratio_to_hf_noise > SYSTEMATIC_NOISE_RATIO else "match")
    # on this CPU vLLM's bfloat16 gap is about HF's own (issue 40's held-out null): judged like against like
    assert r.dtypes["bfloat16"].verdict["level"] in ("match", "systematic", "close")
    assert any("HF's own noise" in x for x in r.dtypes["bfloat16"].verdict["reasons"])
    assert store.load_diagnostics(r.diagnostics_id) == r
    assert store.diagnostics_for_run(r.run_ids["bfloat16"]).diagnostics_id == r.diagnostics_id
    listed = store.list_diagnostics()
    assert r.diagnostics_id in set(listed["diagnostics_id"])
    text = diagnostics_text(r)
    assert "== noise ==" in text and "== reference ==" in text and "== downstream ==" in text


def test_dashboard_shows_diagnostics(demo_diag, monkeypatch):
    store, r = demo_diag
    monkeypatch.setenv("LOGPROB_PARITY_HOME", str(store.root))
    st.cache_resource.clear()
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/diagnostics.py")
    at.query_params["diag"] = r.diagnostics_id
    at.run()
    assert not at.exception
    from logprob_parity.analysis.verdict import diagnosis_verdicts

    shown = " ".join(b.value for b in [*at.success, *at.warning, *at.error])
    assert all(v.headline in shown for v in diagnosis_verdicts(r).values())
    assert len(at.dataframe) >= 3
    noise = at.dataframe[0].value
    assert "gap / HF's own noise" not in set(noise["what"]) and not any("_" in w for w in noise["what"])  # words, no ratio row
    assert any("HF's own noise" in m.value for m in at.metric)
    # the comparison view now draws the noise floor and states the ratio
    at2 = AppTest.from_file(APP, default_timeout=60)
    at2.query_params["runs"] = ",".join(r.run_ids.values())
    at2.run()
    assert not at2.exception
    words = r.dtypes["bfloat16"].floor["noise_words"]
    assert any(
        f"HF's own floor of {r.dtypes['bfloat16'].floor['hf']:.2g} (HF against itself on the text: stored diagnostics; {words})"
        in c.value
        for c in at2.caption
    )
    st.cache_resource.clear()


def test_knob_ablation(home, tiny_bos):
    spec = RunSpec(texts=("Shall I compare thee to a summer's day?",), model=str(tiny_bos), dtypes=("float32",), top_k=3)
    r = diagnose(spec, store=Store(home), parts=("ablation",))
    rows = list(r.ablation)
    assert rows[0]["knob"] == "baseline" and rows[0]["change"] == 0.0
    tried = [x for x in rows[1:] if x["mean_abs_delta"] is not None]
    skipped = [x for x in rows[1:] if x["mean_abs_delta"] is None]
    assert {x["knob"] for x in tried} >= {
        "vLLM prefix caching on",
        "vLLM chunked prefill, max_num_batched_tokens=32",
        "HF attn_implementation=eager",
    }
    assert all(x["note"].startswith(("skipped", "failed")) for x in skipped) and skipped
    assert all(Store(home).has(x["run_id"]) for x in tried)
    lines = knob_lines(rows)
    for x in tried:  # each setting that changed the gap is named once, as what it did
        if x["change"] < 0 and any(f"{x['knob']} removes" in ln for ln in lines):
            assert x["change"] == min(r["change"] for r in tried)
        if x["change"] > 0:
            assert any(f"{x['knob']} widens it" in ln for ln in lines) and not any(f"{x['knob']} removes" in ln for ln in lines)
    print([(x["knob"], x["mean_abs_delta"], x["change"], x["note"]) for x in rows])


def test_the_remedy_named_is_never_a_setting_that_widens_the_gap():
    """One meaning per line: the setting that removes the most is the remedy; one that widens the gap
    is listed as widening it, never as 'the knob that moves the gap most'."""
    rows = [
        {"dtype": "float32", "knob": "baseline", "mean_abs_delta": 1e-3, "change": 0.0},
        {"dtype": "float32", "knob": "TF32 matmuls (both engines)", "mean_abs_delta": 3.7e-3, "change": 2.7e-3},
        {"dtype": "float32", "knob": "vLLM attention_backend=FLEX_ATTENTION", "mean_abs_delta": 3e-6, "change": -9.97e-4},
        {"dtype": "float32", "knob": "vLLM batch-invariant mode", "mean_abs_delta": 3.2e-3, "change": 2.2e-3},
        {"dtype": "float32", "knob": "HF attn_implementation=eager", "mean_abs_delta": None, "change": None},
    ]
    lines = knob_lines(rows)
    assert (
        lines[0]
        == "float32: vLLM attention_backend=FLEX_ATTENTION removes the most of the gap, 99.7% (mean |Δ logp| 1.00e-03 → 3.00e-06)"
    )
    assert lines[1].startswith("float32: TF32 matmuls (both engines) widens it 3.7x")
    assert lines[2].startswith("float32: vLLM batch-invariant mode widens it 3.2x") and len(lines) == 3
    only_worse = [r for r in rows if r["knob"] in ("baseline", "TF32 matmuls (both engines)")]
    assert knob_lines(only_worse)[0] == "float32: no single setting tried here narrows the gap"
    assert not any("removes" in ln for ln in knob_lines(only_worse))


def test_report_carries_the_diagnostics(demo_diag, tmp_path):
    from logprob_parity.present.report import report_html

    store, r = demo_diag
    runs = [store.load(rid) for rid in r.run_ids.values()]
    page = report_html(runs, r)
    assert "Noise floor" in page and "High-precision reference" in page and "Downstream" in page
    assert "HF&#x27;s own noise" in page or "HF's own noise" in page


class _Recording:
    """An HF engine host that records the texts of each scoring call; its identity (`address`,
    `loads`) is the host's unless `address` is given (another engine)."""

    def __init__(self, host, address=None) -> None:
        self.host, self.calls = host, []
        self.address = address or host.address

    def __getattr__(self, name):
        return getattr(self.host, name)

    def score(self, seqs, *args):
        self.calls.append(("score", [tuple(s) for s in seqs]))
        return self.host.score(seqs, *args)

    def rollout_score(self, seqs, *args, **kw):
        self.calls.append(("rollout_score", [tuple(s) for s in seqs]))
        return self.host.rollout_score(seqs, *args, **kw)


def test_a_second_floor_on_one_engine_scores_the_bundled_texts_once_and_is_the_same_floor(tiny_bos):
    """floors.BUNDLED: the texts that top a short sample up are scored alone and chunk by chunk once per
    loaded engine; the next floor on that engine (of the same sample, or of a longer one that takes
    fewer of them) takes their values and comes out equal in every figure. Another engine scores them
    itself; an engine warmed ahead (the dashboard's prewarm) scores none of them in its first floor."""
    from logprob_parity.analysis import floors
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.engines.pool import POOL

    texts = ("Dave lives in Palm Coast.", " ".join(["Dave lives in Palm Coast, FL and is a lawyer."] * 8))
    p = prepare(RunSpec(texts=texts, model=str(tiny_bos), device="cpu"), Context.of())
    hreq = p.load("hf", "float32")
    others = floors.other_prompts(p.tokenizer, p.spec.bos, hreq.max_model_len, "cpu")
    with POOL.lease([hreq]) as lease:
        host = lease.host(hreq)
        short, longer = [list(p.seqs[0])], [list(p.seqs[1])]
        bases = {id(x): [s.logprob for s in host.score(x, 1, None, 1)] for x in (short, longer)}
        # addresses of our own: the session's earlier floors on this host leave nothing for these
        first, again, grown, other, warmed = (_Recording(host, address=a) for a in ("e1", "e1", "e1", "e2", "e3"))
        got = [floors.hf_variations(h, short, bases[id(short)], others, "cpu") for h in (first, again, other)]
        fewer = floors.hf_variations(grown, longer, bases[id(longer)], others, "cpu")
        floors.BUNDLED.warm(warmed, others)
        warm_calls = len(warmed.calls)
        got.append(floors.hf_variations(warmed, short, bases[id(short)], others, "cpu"))
        fresh = floors.hf_variations(_Recording(host, address="e4"), longer, bases[id(longer)], others, "cpu")

    added = got[0][0]["micro_batch"]["texts_added"]
    bundled = {tuple(o) for o in others}
    assert 0 < fewer[0]["micro_batch"]["texts_added"] < added  # the longer sample takes fewer of them
    assert got[0] == got[1] == got[2] == got[3] and fewer == fresh  # the same floor, every figure

    def bundled_passes(h, calls=None):  # the top-up's pass (bundled texts alone) and chunked passes of bundled texts
        calls = h.calls if calls is None else calls
        return [(op, s) for op, ts in calls for s in ts if s in bundled and (op == "rollout_score" or set(ts) <= bundled)]

    assert len(bundled_passes(first)) == 2 * added, first.calls
    assert bundled_passes(again) == bundled_passes(grown) == [], (again.calls, grown.calls)
    assert bundled_passes(other) == bundled_passes(first)
    assert bundled_passes(warmed, warmed.calls[:warm_calls]) and bundled_passes(warmed, warmed.calls[warm_calls:]) == []
    assert ("rollout_score", [tuple(short[0])]) in again.calls  # the sample's own chunks are scored every time


class _NoRoomForALargeBatch(_Recording):
    """An HF engine host whose padded batches of more than one text run out of device memory, with the
    words the host sends for a torch OutOfMemoryError (an 8B model's 32,000-token text on an 80 GB card)."""

    def score(self, seqs, top_k, gather_ids=None, batch_size=None, *args):
        if (batch_size or 1) > 1:
            import torch

            from logprob_parity.engines.host import _describe_error
            from logprob_parity.errors import UserError

            kind, text = _describe_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.98 GiB."))
            assert kind == "user"
            raise UserError(f"hf (bfloat16): {text}")
        return super().score(seqs, top_k, gather_ids, batch_size, *args)


def test_a_large_batch_that_runs_out_of_memory_leaves_the_floor_to_the_other_variations_and_says_so(tiny_bos):
    """The floor's large batch pads every row to the longest text. Where that does not fit on the device,
    micro_batch and padding_side are 'not measured' with the reason, and the floor, its tail and its
    words come from the variations that did run (packed, chunked_kv) instead of the comparison failing."""
    from logprob_parity.analysis import floors
    from logprob_parity.analysis.request import Context, prepare
    from logprob_parity.engines.pool import POOL

    p = prepare(
        RunSpec(texts=("Dave lives in Palm Coast, FL and is a lawyer.",), model=str(tiny_bos), device="cpu"), Context.of()
    )
    hreq = p.load("hf", "float32")
    others = floors.other_prompts(p.tokenizer, p.spec.bos, hreq.max_model_len, "cpu")
    with POOL.lease([hreq]) as lease:
        host = lease.host(hreq)
        seqs = [list(p.seqs[0])]
        base = [s.logprob for s in host.score(seqs, 1, None, 1)]
        full, _ = floors.hf_variations(host, seqs, base, others, "cpu")
        short, skipped = floors.hf_variations(_NoRoomForALargeBatch(host), seqs, base, others, "cpu")

    assert set(skipped) == {"micro_batch", "padding_side"}
    assert "did not fit in the device's memory" in skipped["micro_batch"]
    assert set(short) == set(full) - {"micro_batch", "padding_side"} == {"packed", "chunked_kv", "envelope"}
    for k in ("packed", "chunked_kv"):  # the variations that ran gave what they give beside the large batch
        assert short[k] == full[k], k
    floor = floors.floor_of(short)
    assert floor["noise_set_by"] in ("packed", "chunked_kv") and floor["hf_noise_mean"] is not None
    assert short["envelope"]["n"] == full["micro_batch"]["n"] and short["envelope"]["texts_added"] > 0
    rows = floors.floor_rows(short, skipped)
    assert rows["micro_batch"]["what"].startswith("not measured: the large batch")
