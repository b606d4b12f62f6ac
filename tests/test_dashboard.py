"""Streamlit AppTest of each page; one drives the real engines on a tiny model."""

import html
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
from test_store import make_run

from logprob_parity.results.store import Store

APP = str(Path(__file__).resolve().parent.parent / "logprob_parity" / "dashboard" / "app.py")
HOSTILE = ("<script>alert(1)</script>", "<img src=x onerror=alert(1)>")


@pytest.fixture(autouse=True)
def fresh_caches(home):
    """Each test gets its own store root; cached handles from other tests must not leak in."""
    st.cache_resource.clear()
    st.cache_data.clear()
    yield
    st.cache_resource.clear()
    st.cache_data.clear()


def _html(at: AppTest) -> str:
    """The pages' HTML elements, less the fixed scroll anchors (alerts.bring_into_view: the one script a
    page draws, fixed text with no data in it)."""
    bodies = [getattr(e, "proto", None).body for e in at.get("html") if hasattr(e.proto, "body")]
    return "".join(b for b in bodies if not b.startswith('<div id="lpp-') or '-anchor"></div>\n<script>' not in b)


def test_compare_page_opens_a_stored_run_and_escapes_tokens(home):
    text = " ".join(HOSTILE)
    Store(home).save(make_run("feed01", texts=(text,)))
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "feed01"
    at.run()
    assert not at.exception
    body = _html(at)
    assert body.count('class="lpp-tok') == 4
    assert "<script" not in body and "<img" not in body
    k = len(text) // 3  # the pieces, escaped, are in the view as text
    assert all(html.escape(p, quote=True) in body for p in (text[:k], text[k : 2 * k], text[2 * k :]))
    assert "HF    logprob" in body and "vLLM  logprob" in body
    labels = [m.label for m in at.metric]
    assert "largest gap, |Δ logp|" in labels and "same top token" in labels
    # the view state is in the URL
    assert at.query_params["runs"] == "feed01" and at.query_params["metric"] == "abs_delta"


def test_three_dtypes_cards_show_whole_numbers_with_the_exact_value_beside(home):
    """Item 1 of the first hour: three dtypes side by side cut "1.769e-02" to "1.769…" on the cards, so
    float32 read as worse than bfloat16. Every card's number is at most 7 characters, reads back to
    the value it stands for (2 significant digits), and its help holds the exact value."""
    import re

    from logprob_parity.dashboard.components.run_view import card_number

    for v, want in ((1.769e-02, "0.018"), (8.703e-02, "0.087"), (1.335e-05, "1.3e-05"), (0.0, "0"), (0.9996, "1")):
        assert card_number(v) == want
    assert card_number(0.9996, pct=True) == ">99.9%" and card_number(None) == "–"
    ids = []
    for k, (dtype, scale) in enumerate((("float32", 1.335e-5), ("bfloat16", 8.703e-2), ("float16", 1.769e-2))):
        run = make_run(f"ca7d{k:04d}", dtype=dtype)
        summary = {**run.summary, "mean_abs_delta": scale, "max_abs_delta": scale * 7.3, "p95_abs_delta": scale * 3.1}
        Store(home).save(type(run)(meta=__import__("dataclasses").replace(run.meta, summary=summary), sequences=run.sequences))
        ids.append(run.run_id)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = ",".join(ids)
    at.run()
    assert not at.exception
    cards = [m for m in at.metric if "gap" in m.label or "below" in m.label]
    assert len(cards) == 9
    for m in cards:
        assert len(m.value) <= 7 and re.fullmatch(r"[0-9.e+-]+", m.value), m.value
        exact = float(m.proto.help.rsplit("Exactly: ", 1)[1].rstrip("."))
        assert float(m.value) == pytest.approx(exact, rel=0.05), (m.label, m.value, exact)
    means = {m.value for m in cards if m.label.startswith("mean")}
    assert means == {"1.3e-05", "0.087", "0.018"}


def test_view_state_from_the_url(home):
    Store(home).save(make_run("feed02"))
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params.update({"runs": "feed02", "seq": "1", "metric": "kl_topk", "thr": "1e-05"})
    at.run()
    assert not at.exception
    assert at.selectbox(key="compare-metric").value == "kl_topk"
    assert at.number_input(key="compare-seq").value == 2  # ?seq=1 is the second text, numbered from 1 for people
    assert "top-k KL" in _html(at)


@pytest.mark.parametrize("runs", ["nothex!", "deadbeef", ",,,", "a" * 500])
def test_malformed_or_unknown_run_ids_warn(home, runs):
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params.update({"runs": runs, "seq": "x", "metric": "<b>", "thr": "nan?"})
    at.run()
    assert not at.exception
    if runs.strip(","):
        assert at.warning and ("no stored run" in at.warning[0].value or "not a run id" in at.warning[0].value)


def test_runs_page_deletes_after_asking_then_says_so_with_the_selection_cleared(home):
    """Delete asks first, naming the run by id, text (cut at a word's end), dtype and settings (item 5 of
    the first hour: it cut the text mid-word, gave no id, and rows that differ only in their settings
    read alike, so the table shows the settings that differ from the defaults)."""
    store = Store(home)
    long = "Dave lives in Palm Coast and likes to go hiking on weekends with his family"
    store.save(make_run("abc111", texts=(long,)))
    store.save(make_run("abc222", texts=(long,), settings={"hf_batch_size": 8}))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()  # st.navigation registers the pages on the first run
    at.switch_page("views/runs.py")
    at.run()
    assert not at.exception
    assert at.title[0].value == "Stored runs"
    df = at.dataframe[0].value
    assert set(df["run ids"]) == {"abc111", "abc222"}
    assert dict(zip(df["run ids"], df["settings"])) == {"abc111": "defaults", "abc222": "hf_batch_size=8"}
    assert [b.label for b in at.button] == ["Open selected", "Delete selected", "Diff the two selected runs"]
    row = list(df["run ids"]).index("abc111")
    at.session_state["runs-table-0"] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.run()
    at.button(key="runs-table-delete").click().run()
    assert not at.exception
    assert store.has("abc111")  # asked first: nothing is deleted yet
    question = " ".join(w.value for w in at.warning)
    # the text between Unicode isolates: a right-to-left text cannot pull the comma after it to its side
    assert (
        "Delete 1 run: abc111 (“\u2068Dave lives in Palm Coast and likes to go…\u2069”, float32, settings: defaults)" in question
    )
    assert "cannot be undone" in question
    at.button(key="runs-table-cancel").click().run()
    assert store.has("abc111") and not at.warning  # cancelled: kept, and the question gone
    at.button(key="runs-table-delete").click().run()
    at.button(key="runs-table-yes").click().run()
    assert not at.exception
    assert not store.has("abc111") and store.has("abc222")
    assert set(at.dataframe[0].value["run ids"]) == {"abc222"}
    assert any("Deleted 1 run" in s.value and "abc111" in s.value for s in at.success)
    assert "runs-table-0" not in at.session_state and "runs-table-1" in at.session_state  # a new table: no tick left
    assert not at.session_state["runs-table-1"]["selection"]["rows"]


def test_runs_page_lists_a_comparison_in_two_dtypes_as_one_row(home):
    store = Store(home)
    store.save(make_run("cafe32", dtype="float32"))
    store.save(make_run("cafe16", dtype="bfloat16"))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/runs.py")
    at.run()
    assert not at.exception
    df = at.dataframe[0].value
    assert len(df) == 1 and df["dtypes"][0] == "bfloat16, float32"
    assert set(df["run ids"][0].split(",")) == {"cafe32", "cafe16"}


def test_prompt_set_page_shows_aggregates(home):
    Store(home).save(make_run("beef01", texts=("first prompt", "second <b>bold</b>")))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()  # st.navigation registers the pages on the first run
    at.switch_page("views/prompt_set.py")
    at.query_params.update({"runs": "beef01", "seq": "1"})
    at.run()
    assert not at.exception
    assert at.title[0].value == "Prompt set"
    tables = [d.value for d in at.dataframe]
    assert "float32" in tables[0].columns and "largest gap |Δ logp|" in tables[0].index and "max_abs_delta" not in tables[0].index
    assert sorted(tables[1]["text"]) == ["first prompt", "second <b>bold</b>"]  # shown as text by the grid
    gaps = list(tables[1]["largest gap float32"])
    assert gaps == sorted(gaps, reverse=True)  # the prompt with the largest gap first
    assert " &lt;b&gt;bo" in _html(at) and "ld&lt;/b&gt;" in _html(at)  # prompt 1 (from ?seq=1), escaped
    assert sorted(tables[1]["prompt"]) == [1, 2]  # numbered from 1 for people


def test_the_prompt_set_table_has_each_prompts_verdict_and_opens_the_worst_prompt(home):
    """Item 4 of the first hour: the per-prompt table had no verdict column (a prompt's verdict showed
    only when opened), and it listed prompt 5 first but opened prompt 1."""
    from logprob_parity.analysis.verdict import prompt_verdicts

    texts = ("first prompt", "a second one", "the third <b>prompt</b> here")
    run = make_run("beef02", texts=texts)
    Store(home).save(run)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/prompt_set.py")
    at.query_params.update({"runs": "beef02"})  # a link without a prompt named
    at.run()
    assert not at.exception
    table = at.dataframe[1].value
    back = Store(home).load("beef02")
    for prompt, level in zip(table["prompt"], table["verdict float32"]):
        assert level == prompt_verdicts([back], int(prompt) - 1)[0].title  # the words it reads when opened
    top = int(table["prompt"].iloc[0])
    assert top == 3 and list(table["largest gap float32"]) == sorted(table["largest gap float32"], reverse=True)
    assert at.subheader[-1].value.startswith(f"Prompt {top} of 3")  # the top row is the one opened
    assert at.query_params["seq"] == str(top - 1)


@pytest.mark.engine
def test_the_bundled_sample_set_runs_in_one_click(home):
    """Item 4 of the first hour: Run on the Prompt set page said "Upload a prompt file first" and there
    was no sample to try; one click now runs the bundled set on the demo model."""
    from logprob_parity.inputs.prompts import sample_set

    at = AppTest.from_file(APP, default_timeout=900)
    at.run()
    at.switch_page("views/prompt_set.py")
    at.run()
    at.button(key="ps-sample").click()
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    n = len(sample_set().texts)
    assert any(f"{n} prompts from the bundled sample set" in m.value for m in at.success)
    assert at.dataframe[1].value.shape[0] == n and "verdict float32" in at.dataframe[1].value.columns
    assert at.query_params["runs"]


def test_a_prompt_of_a_set_shows_its_own_verdict_and_numbers_and_the_sets_are_labelled(home):
    """Under "Prompt 1" the cards are prompt 1's (its largest gap is half the set's here), and the whole
    set's verdict is labelled as the set's."""
    run = make_run("beef02", texts=("first prompt", "second prompt, with larger gaps"))
    Store(home).save(run)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/prompt_set.py")
    at.query_params.update({"runs": "beef02", "seq": "0"})
    at.run()
    assert not at.exception
    heads = [h.value for h in at.subheader]
    assert any(h.startswith("The whole set: all 2 prompts") for h in heads), heads
    assert any(h.startswith("Prompt 1 of 2") for h in heads), heads
    own, whole = run.meta.sequences[0].summary["max_abs_delta"], run.summary["max_abs_delta"]
    assert own < whole
    largest = [m.value for m in at.metric if m.label == "largest gap, |Δ logp|"]
    from logprob_parity.dashboard.components.run_view import card_number

    assert largest == [card_number(own)], (largest, own, whole)
    verdicts = [s.value for kind in (at.success, at.info, at.warning, at.error) for s in kind if "float32:" in s.value]
    assert len(verdicts) == 2  # the set's and the prompt's


@pytest.mark.engine
def test_compare_page_runs_the_real_engines(home, tiny_bos):
    at = AppTest.from_file(APP, default_timeout=900)
    at.run()
    at.text_input(key="compare-custom").input(str(tiny_bos))  # typed, the preset left on the demo: the typed one runs
    at.text_area(key="compare-text").input("Shall I compare thee to a summer's day? <script>alert(1)</script>")
    at.checkbox(key="compare-dt-bfloat16").uncheck()
    at.button[0].click()
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    rid = at.query_params["runs"]
    assert Store(home).has(rid)
    body = _html(at)
    assert body.count('class="lpp-tok') > 10 and "&lt;" in body and "<script" not in body
    # a bad request keeps the app up and says why
    at.text_area(key="compare-text").input("   ")
    at.button[0].click()
    at.run()
    assert not at.exception and "empty" in at.error[0].value


def test_a_hub_preset_is_offered_only_where_it_can_load_else_named_with_the_reason(home, monkeypatch):
    """Item 6 of the first hour: the model list offered "facebook/opt-125m (Hub)" on a machine with no
    Hub. Offline and not cached, it is not in the list, and the form says why; cached (or the Hub
    answering), it is offered."""
    from logprob_parity.inputs import models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: None)
    assert "HF_HUB_OFFLINE" in models.hub_model_why_not("facebook/opt-125m")
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception
    assert at.selectbox(key="compare-preset").options == ["demo: SmolLM2-135M-Instruct (embedded, offline)"]
    said = " ".join(c.value for c in at.caption)
    assert "facebook/opt-125m (Hub): not offered here, not in this machine's Hugging Face cache" in said
    st.cache_data.clear()
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert "facebook/opt-125m (Hub)" in at.selectbox(key="compare-preset").options
    assert "facebook/opt-125m (Hub): not offered" not in " ".join(c.value for c in at.caption)


def test_a_shared_link_fills_the_form_with_what_the_view_shows(home, monkeypatch):
    """Pressing Run after opening a link recomputes what is on screen: text, model, dtypes, top-k, settings."""
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: "/cache/config.json")  # offered
    text = "Shalom שלום, pizza 🍕 and 你好"
    # CPU_ATTN: the backend this machine's vLLM build runs (the others are not offered here, with the reason)
    settings = {"attention_backend": "CPU_ATTN", "enforce_eager": False, "max_num_seqs": 8, "max_model_len": 256}
    Store(home).save(
        make_run("f00d16", texts=(text,), dtype="bfloat16", model="facebook/opt-125m", top_k=3, bos="none", settings=settings)
    )
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "f00d16"
    at.run()
    assert not at.exception
    assert at.text_area(key="compare-text").value == text
    assert at.selectbox(key="compare-preset").value == "facebook/opt-125m (Hub)"
    assert at.checkbox(key="compare-dt-bfloat16").value and not at.checkbox(key="compare-dt-float32").value
    assert at.number_input(key="compare-topk").value == 3 and at.radio(key="compare-bos").value == "none"
    assert at.selectbox(key="compare-set-attention_backend").value == "CPU_ATTN"
    assert at.checkbox(key="compare-set-enforce_eager").value is False
    assert at.number_input(key="compare-set-max_num_seqs").value == 8
    # another run opened in the same session fills the form again
    Store(home).save(make_run("f00d32", texts=("second text",), dtype="float32", model="facebook/opt-125m"))
    at.query_params["runs"] = "f00d32"
    at.run()
    assert at.text_area(key="compare-text").value == "second text"
    assert at.checkbox(key="compare-dt-float32").value and not at.checkbox(key="compare-dt-bfloat16").value
    # where the Hub preset is not offered, the model goes in the field, which is what runs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: None)
    st.cache_data.clear()
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "f00d16"
    at.run()
    assert at.text_input(key="compare-custom").value == "facebook/opt-125m"


def test_a_local_folder_or_demo_run_fills_the_model_choice(home):
    Store(home).save(make_run("d0d0", model="demo:SmolLM2-135M-Instruct"))
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "d0d0"
    at.run()
    assert at.selectbox(key="compare-preset").value.startswith("demo:")
    Store(home).save(make_run("f01d", model="/models/mine", texts=("other",)))
    at.query_params["runs"] = "f01d"
    at.run()
    assert at.text_input(key="compare-custom").value == "/models/mine"  # the field that wins when filled


def test_a_long_truncated_text_says_so_and_is_drawn_a_window_at_a_time(home):
    pieces = [f" w{i}" for i in range(1199)]
    Store(home).save(make_run("10a9", texts=("".join(pieces),), pieces=[pieces], cut_from=47_799))
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "10a9"
    at.run()
    assert not at.exception
    assert any("cut from 47,799 to 1,200 tokens" in w.value and "'Truncate prompts" in w.value for w in at.warning)
    window = at.selectbox(key="compare-window-0")
    assert "shown 512 at a time, the part with the largest gap first" in window.label
    assert _html(at).count('class="lpp-tok') <= 512
    # the windows are ordered by their largest gap, worst first
    from logprob_parity.present.render import windows
    from logprob_parity.results.store import Store as S

    parts = windows([S(home).load("10a9")], 0, 512)
    assert [p[2] for p in parts] == sorted((p[2] for p in parts), reverse=True)
    assert sorted((a, b) for a, b, _ in parts) == [(0, 512), (512, 1024), (1024, 1200)]


@pytest.mark.parametrize("texts,page", [(("one text",), "vLLM vs HF log probabilities"), (("first", "second"), "Prompt set")])
def test_runs_page_opens_a_comparison_where_all_its_prompts_show(home, texts, page):
    Store(home).save(make_run("0be1", texts=texts))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.switch_page("views/runs.py")
    at.run()
    at.session_state["runs-table-0"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    at.button[0].click().run()
    assert not at.exception
    assert at.title[0].value == page and at.query_params["runs"] == "0be1"


def _open(page: str, **query: str) -> AppTest:
    """The app on one page (views/<page>.py) with these query parameters, run once."""
    at = AppTest.from_file(APP, default_timeout=60)
    at.switch_page(f"views/{page}.py")
    at.query_params.update(query)
    at.run()
    return at


def make_rollout(rollout_id: str = "abc123", text: str = "The sea <b>is</b> 🌊 مرحبا 海"):
    """A stored rollout built by hand (plumbing for page tests; tests/test_rollout.py runs the engines)."""
    import numpy as np

    from logprob_parity.analysis.verdict import rollout_verdict
    from logprob_parity.results.offpolicy import mismatch_metrics
    from logprob_parity.results.records import RunEnv
    from logprob_parity.results.rollout import PAIRS, Rollout, RolloutMeta, Sample, with_bands

    pieces = (" <script>x</script>", " 🌊", " مرحبا", " 海")
    decode = np.log([0.5, 0.25, 0.9, 0.3])
    hf = decode + np.array([0.0, 0.05, -0.003, 0.3])
    lp = {
        "decode_raw": decode,
        "decode_processed": decode,
        "prefill": decode.copy(),
        "hf": hf,
        "hf_tempered": hf,
        "log_kept_mass": np.zeros(4),
    }
    smp = Sample(0, 0, (1, 2, 3), (10, 11, 12, 13), pieces, "length", lp)
    summary = {p: mismatch_metrics([lp[a]], [lp[b]]) for p, (a, b, _) in PAIRS.items()}
    floors = {
        "hf_incremental": {"mean": 1e-6, "max": 2e-6, "n": 4, "side": "hf", "what": "HF: one token a forward"},
        "decode_batch": {"mean": 0.0, "max": 0.0, "n": 4, "same_tokens": 1, "of": 1, "side": "vllm", "what": "alone"},
    }
    summary = with_bands(summary, floors, "bfloat16", [(lp["decode_raw"], lp["hf"])])  # as a rollout stores them
    meta = RolloutMeta(
        rollout_id=rollout_id,
        created="2026-12-03T00:00:00+00:00",
        created_ts=1.0,
        model="demo:tiny",
        model_path="/m",
        revision=None,
        model_identity={},
        dtype="bfloat16",
        device="cpu",
        bos="auto",
        settings={},
        sampling={"samples": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4, "seed": 0, "ignore_eos": False},
        prompts=(text,),
        processed="equal to raw",
        env=RunEnv("cpu", "t", "tf", "v"),
        timing={},
        summary=summary,
        floors=floors,
        samples=(smp.info(),),
    )
    import dataclasses

    meta = dataclasses.replace(meta, verdict=rollout_verdict(meta).to_dict())
    return Rollout(meta=meta, samples=(smp,))


def test_rollout_page_opens_a_stored_rollout_escaped_with_its_verdict_first(home):
    Store(home).save_rollout(make_rollout())
    at = _open("rollout", rollout="abc123")
    assert not at.exception
    body = _html(at)
    assert body.count('class="lpp-tok') == 4 and "<script>x" not in body and "&lt;script&gt;x" in body
    assert " 🌊" in body and " مرحبا" in body and " 海" in body and "The sea &lt;b&gt;is&lt;/b&gt;" in body
    assert "vLLM decode (raw)" in body and "importance ratio HF/decode" in body
    boxes = [e.value for e in [*at.error, *at.warning, *at.success]]
    # 2 of 4 tokens beyond the tolerance, one of them moving a probability from 0.3 to 0.4: it changes results
    assert any(b.startswith("**Differs.** Rollout bfloat16") for b in boxes), boxes
    tables = {d.key: d.value for d in at.dataframe if d.key}
    assert {"rollout-worst-seq", "rollout-worst-tok"} <= set(tables)  # where the ratio breaks most, worst first
    assert any("decode vs HF" in d.value.columns for d in at.dataframe) and len(at.dataframe) >= 4


def test_rollout_page_says_what_is_wrong_with_bad_input(home):
    at = _open("rollout")
    at.text_area(key="rollout-text").set_value("   \n  ")
    at.get("form_submit_button")[0].click()
    at.run()
    assert not at.exception
    assert [e.value for e in at.error] == ["Enter at least one prompt: one a line, each a text the model continues."]
    assert at.query_params.get("rollout") is None


def test_runs_page_lists_rollouts_and_opens_one(home):
    Store(home).save_rollout(make_rollout("abc124"))
    at = _open("runs")
    assert not at.exception
    table = at.dataframe[0].value
    assert table["id"].tolist() == ["abc124"] and "n=1 T=1" in table["sampling"].iloc[0]


def make_frontier(frontier_id: str = "fee123"):
    """A stored frontier built by hand (plumbing for page tests; tests/test_frontier.py runs the engines)."""
    from logprob_parity.analysis.frontier import FrontierResult, pareto, recommend

    def row(name, dtype, gap, speed, skipped=None):
        return {
            "name": name,
            "dtype": dtype,
            "settings": {},
            "skipped": skipped,
            "start_s": 12.0,
            "ref_gap": None if skipped else {"mean": gap, "max": 3 * gap, "kl_mean": gap / 10},
            "hf_ref_gap": None if skipped else {"mean": gap / 2, "max": gap, "kl_mean": None},
            "tokens_per_s": None
            if skipped
            else {
                "prefill": speed,
                "generate": speed / 10,
                "repeats": 3,
                "prefill_spread": [0.9 * speed, 1.1 * speed],
                "generate_spread": [0.09 * speed, 0.11 * speed],
                "load": "4 x 128 tokens",
            },
            "memory": None
            if skipped
            else {
                "weights_bytes": (4 if dtype == "float32" else 2) * 135_000_000,
                "kv_bytes_per_token": 92_160 if "fp8" in name else 184_320,
                "kv_cache_bytes": 64 << 20,
            },
        }

    rows = [
        row("float32", "float32", 9e-6, 40.0),
        row("bfloat16", "bfloat16", 4e-2, 600.0),
        row("bfloat16 kv_cache_dtype=fp8", "bfloat16", 0.24, 90.0),
        row("bfloat16 quantization=fp8", "bfloat16", None, None, skipped="vLLM could not start it: <b>no fp8 kernel</b>"),
    ]
    for r in rows:
        r["pareto"] = r["name"] in pareto(rows)
    return FrontierResult(
        frontier_id=frontier_id,
        model="demo:tiny",
        device="cpu",
        versions={"torch": "t"},
        texts=("Hi 🌊 مرحبا",),
        n_tokens=5,
        tolerance={"value": 2e-5, "source": "given"},
        configs=tuple(rows),
        recommendation=recommend(rows, 2e-5, "given"),
        created="2026-12-03",
        created_ts=2.0,
        speed={"load": "4 x 128 tokens", "repeats": 3, "gen_tokens": 32},
    )


def test_frontier_page_opens_a_stored_frontier_with_its_recommendation_and_the_skipped_ones(home):
    Store(home).save_frontier(make_frontier())
    at = _open("frontier", frontier="fee123")
    assert not at.exception
    assert next(s.value for s in at.success).startswith("**Recommended: float32.**")
    assert any("bfloat16 quantization=fp8" in w.value and "no fp8 kernel" in w.value for w in at.warning)
    table = at.dataframe[0].value
    assert list(table["configuration"]) == ["float32", "bfloat16", "bfloat16 kv_cache_dtype=fp8"]  # the skipped one is above
    assert not table.isna().any().any()


def test_frontier_page_refuses_a_bad_configuration_in_words(home):
    at = _open("frontier")
    at.text_input(key="frontier-extra").set_value("float32 warp=9")
    at.get("form_submit_button")[0].click()
    at.run()
    assert not at.exception
    assert any("known setting" in e.value for e in at.error), [e.value for e in at.error]
    # it says what to type on the page, not a command-line pointer
    assert any("attention_backend" in e.value and "e.g. 'float32" in e.value and "--help" not in e.value for e in at.error)
    assert at.query_params.get("frontier") is None


def test_a_quantized_run_says_hf_is_the_unquantized_reference(home):
    run = make_run("feed09")
    import dataclasses

    run = dataclasses.replace(run, meta=dataclasses.replace(run.meta, settings={**run.meta.settings, "kv_cache_dtype": "fp8"}))
    Store(home).save(run)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["runs"] = "feed09"
    at.run()
    assert not at.exception
    assert any("quantized (fp8 KV cache); HF is the unquantized reference" in i.value for i in at.info), [
        i.value for i in at.info
    ]


def test_runs_page_lists_frontiers_with_their_recommendation(home):
    Store(home).save_frontier(make_frontier("fee789"))
    at = _open("runs")
    assert not at.exception
    table = at.dataframe[0].value
    assert table["id"].tolist() == ["fee789"] and table["recommendation"].tolist() == ["float32"]


def make_big_rollout(rollout_id: str, n: int):
    """A stored rollout of n samples of three tokens (plumbing for the page at scale): sample 1112
    (number 1111 from 0) is the one furthest from 1; the middle token names its sample (" w<i>")."""
    import dataclasses

    import numpy as np

    from logprob_parity.results.rollout import Rollout, Sample

    base = make_rollout(rollout_id)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        d = rng.normal(0, 1e-3, 3)
        d[1] += 0.5 if i == 1111 else 0.0
        lp = {c: v[:3] for c, v in base.samples[0].logprob.items()}
        lp = {**lp, "hf": lp["decode_raw"] - d, "hf_tempered": lp["decode_raw"] - d}
        samples.append(Sample(0, i, (1, 2, 3), (10, 11, 12), (" a", f" w{i}", " c"), "length", lp))
    meta = dataclasses.replace(base.meta, samples=tuple(s.info() for s in samples))
    return Rollout(meta=meta, samples=tuple(samples))


def _arrow_rows(data: bytes) -> int:
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_all().num_rows


def test_rollout_page_on_thousands_of_samples_sends_the_browser_little(home):
    """A rescore of thousands of sequences opens as quickly as a small one: the sample is picked by
    number (no list of every sample on each rerun), the ratio strip draws the 40 sequences furthest
    from 1, the histograms arrive counted (a row a bin), and a number opens that sample's tokens."""
    import json as _json

    from logprob_parity.dashboard.components.rollout_panel import PICK_LIMIT
    from logprob_parity.present.rollout_view import STRIP_SAMPLES

    n = PICK_LIMIT + 200
    Store(home).save_rollout(make_big_rollout("abc777", n))
    at = _open("rollout", rollout="abc777")
    assert not at.exception
    assert [s.label for s in at.selectbox if s.label == "Sample"] == []
    picker = [x for x in at.number_input if x.key == "rollout-sample-no"]
    assert len(picker) == 1 and picker[0].value == 1 and f"1 to {n:,}" in picker[0].label
    specs = [_json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    datasets = [c.proto.datasets for c in at.get("vega_lite_chart")]
    assert len(specs) == 3 and f"{STRIP_SAMPLES} of {n:,} sequences furthest from 1" in _json.dumps(specs[0])
    rows = [[_arrow_rows(d.data.data) for d in ds] for ds in datasets]
    assert sum(rows[0]) == 3 * STRIP_SAMPLES, rows  # three tokens a sequence
    assert all(0 < max(r) <= 61 for r in rows[1:]), rows  # a row a bin, not a row a token
    picker[0].set_value(1112).run()
    assert not at.exception and at.query_params["sample"] == "1111"
    assert " w1111" in _html(at)
    seqs = next(d.value for d in at.dataframe if d.key == "rollout-worst-seq")
    assert int(seqs["sample"].iloc[0]) == 1112  # numbered as the picker numbers them


def test_two_prompt_sets_that_differ_in_one_line_read_apart_on_the_runs_page(home):
    Store(home).save(make_run("5e7a01", texts=("the same first prompt", "second line, one way")))
    Store(home).save(make_run("5e7b02", texts=("the same first prompt", "second line, the other way")))
    at = _open("runs")
    assert not at.exception
    texts = list(at.dataframe[0].value["text"])
    assert len(texts) == 2 and texts[0] != texts[1] and all("(+1 more prompts; set " in t for t in texts), texts


def test_on_a_cpu_the_rollout_and_frontier_forms_default_to_a_short_run_and_say_how_long_beforehand(home):
    at = _open("rollout")
    assert not at.exception
    assert at.number_input(key="rollout-samples").value == 1 and at.number_input(key="rollout-max").value == 16
    assert at.checkbox(key="rollout-floors").value is False  # optional, off on a CPU
    graphs = at.checkbox(key="rollout-graphs")
    assert graphs.value is False and graphs.disabled
    captions = [c.value for c in at.caption]
    assert any("CUDA graphs: GPUs only" in c for c in captions)
    assert any(c.startswith(":material/schedule: About ") and "sampled tokens" in c and "engine" in c for c in captions), captions
    at = _open("frontier")
    assert not at.exception
    assert at.multiselect(key="frontier-configs").value == ["float32", "bfloat16"]
    assert any(c.startswith(":material/schedule: About ") and "2 configuration(s)" in c for c in (c.value for c in at.caption))


def test_diagnostics_offers_its_noise_check_once(home):
    at = _open("diagnostics")
    assert not at.exception
    labels = [c.label for c in at.checkbox]
    assert not any("Measure each engine's own noise" in x for x in labels), labels  # the check is a part above
    assert "noise" in at.multiselect(key="diag-parts").value
    # item 3 of the first hour: Diagnostics said nothing of how long before Run; its estimate counts every engine
    said = [c.value for c in at.caption if c.value.startswith(":material/schedule: About ")]
    assert len(said) == 1 and "engines to start" in said[0] and "not yet timed here" in said[0], said


@pytest.mark.engine
def test_the_rollout_pages_estimate_holds_for_its_own_default_run(home, monkeypatch, cold_start):
    """Item 3 of the first hour: the Rollout page said "About 2 s here" before a run of 18.7 s. Its
    estimate of its own default run on this machine, engine starts included, is within 2x of the time
    the run takes, measured from pressing Run to the result."""
    import time

    from logprob_parity.analysis import estimate
    from logprob_parity.engines import pool

    pool.shutdown_all()  # a fresh server's first rollout: every engine it needs starts, as new processes
    monkeypatch.setattr(estimate, "LAST_START", {})  # no start measured yet in this process
    at = AppTest.from_file(APP, default_timeout=900)
    at.switch_page("views/rollout.py")
    at.run()
    estimated = at.session_state["rollout-estimate"]
    said = next(c.value for c in at.caption if c.value.startswith(":material/schedule: About "))
    t = time.monotonic()
    next(b for b in at.button if b.label == "Run").click()
    at.run()
    took = time.monotonic() - t
    assert not at.exception and not at.error, [e.value for e in at.error]
    print(f"estimate {estimated:.1f} s ({said}); took {took:.1f} s")
    assert estimated / 2 <= took <= estimated * 2, (estimated, took, said)
    over = [w.value for w in at.warning if "estimated before it started" in w.value]
    assert not over, over


def test_only_compare_offers_hf_against_itself_diagnostics_has_no_vllm_gap_to_explain_without_vllm(home):
    label = "Show what noise looks like: HF against itself instead of vLLM"
    compare_page, diagnostics_page = _open("compare"), _open("diagnostics")
    assert not compare_page.exception and not diagnostics_page.exception
    assert [c.label for c in compare_page.checkbox if c.label == label] == [label]
    assert label not in [c.label for c in diagnostics_page.checkbox]
