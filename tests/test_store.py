"""Store plumbing on synthetic scores (no engine): round trip, atomicity, ids, listing."""

import os

import numpy as np
import pytest

from logprob_parity.engines.scores import TokenScores
from logprob_parity.errors import UserError
from logprob_parity.inputs.tokens import TokenizedText
from logprob_parity.results.metrics import concat, summarize
from logprob_parity.results.records import RunMeta
from logprob_parity.results.run import Run, SequenceResult
from logprob_parity.results.store import Store


def _scores(ids, shift, k=2, gather=False):
    s = TokenScores.empty(ids, k)
    rng = np.random.default_rng(len(ids))
    for t in range(1, len(ids)):
        s.logprob[t] = -1.0 - t / 10 + shift
        s.rank[t] = t
        s.topk_ids[t] = [ids[t], 99]
        s.topk_logprobs[t] = [-0.5 + shift, -2.0]
    g = np.where(s.topk_ids >= 0, s.topk_logprobs + rng.normal(0, 1e-3, s.topk_logprobs.shape), np.nan)
    return TokenScores(s.token_ids, s.logprob, s.rank, s.topk_ids, s.topk_logprobs, g if gather else None)


def make_run(run_id="abc123", texts=("a <b>", "c\nd"), pieces=None, dtype="float32", cut_from=None, **meta_overrides):
    """A run with made-up scores; `pieces` (one list per text) sets the tokens, else each text is cut in three.
    `meta_overrides` replace metadata fields (model, settings, top_k, ...)."""
    seqs = []
    for i, text in enumerate(texts):
        if pieces is not None:
            toks = ("<s>", *pieces[i])
        else:
            k = max(1, len(text) // 3)
            toks = ("<s>", text[:k], text[k : 2 * k], text[2 * k :])  # joined pieces rebuild the text
        ids = [1] + [10 + i + j for j in range(len(toks) - 1)]
        tok = TokenizedText(text, tuple(ids), toks, toks, True)
        seqs.append(SequenceResult.build(tok, _scores(ids, 0.0, gather=True), _scores(ids, 1e-3 * (i + 1))))
    summary = summarize(concat([s.metrics for s in seqs]))
    meta = {
        "run_id": run_id,
        "created": "2026-12-02T00:00:00+00:00",
        "created_ts": 1.0,
        "model": "m",
        "model_path": "/m",
        "revision": None,
        "model_identity": {},
        "dtype": dtype,
        "backends": ["hf", "vllm"],
        "settings": {},
        "top_k": 2,
        "bos": "auto",
        "device": "cpu",
        "env": {"device": "cpu", "torch": "t", "transformers": "tf", "vllm": "v"},
        "summary": summary,
        "sequences": [
            {"text": s.text, "bos_added": True, "n_positions": len(s.token_ids), "summary": s.summary, "cut_from": cut_from}
            for s in seqs
        ],
        **meta_overrides,
    }
    return Run(meta=RunMeta.from_dict(meta), sequences=tuple(seqs))


def test_roundtrip_is_exact(tmp_path):
    store = Store(tmp_path)
    run = make_run()
    store.save(run, request_key="k1")
    back = store.load("abc")  # unique prefix
    assert back.from_store and back.run_id == "abc123"
    a, b = run.to_frame(), back.to_frame()
    assert list(a.columns) == list(b.columns)
    for col in ("hf_logprob", "vllm_logprob", "delta", "kl_topk"):
        np.testing.assert_array_equal(a[col].to_numpy(), b[col].to_numpy())  # bit-exact, NaNs included
    assert back.to_json_dict() == run.to_json_dict()
    assert store.lookup_request("k1") == "abc123" and store.lookup_request("nope") is None


def test_a_run_file_keeps_dictionaries_for_its_strings_only(tmp_path):
    """Token names, pieces and the top-k texts repeat, so they are dictionary-encoded; the numbers
    are nearly unique, and a dictionary over them cost most of a run's write (logprob_parity.results.store.
    dictionary_columns). Read back, every text is what was written."""
    import dataclasses

    import pyarrow.parquet as pq

    from logprob_parity.results.positions import batch_table

    ids = [1, 10, 11, 10]
    names = ("<s>", "a", "שלום", "a")  # a right-to-left word among them
    table, infos, _ = batch_table(
        [TokenizedText("a שלום a", tuple(ids), names, names, True)],
        [_scores(ids, 0.0, gather=True)],
        [_scores(ids, 1e-3)],
        lambda seqs: [f"<{s[0]}>" for s in seqs],
    )
    meta = dataclasses.replace(make_run(texts=("a שלום a",)).meta, sequences=tuple(infos))
    store = Store(tmp_path)
    store.write_run(meta, [table])
    group = pq.ParquetFile(store.path_of(meta.run_id)).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)}
    dictionary = {path for path, enc in encodings.items() if any("DICTIONARY" in e for e in enc)}
    assert dictionary == {"token", "piece", "hf_topk_text.list.element", "vllm_topk_text.list.element"}, encodings
    back = store.load(meta.run_id).sequences[0]
    assert back.tokens == names and back.pieces == names
    assert np.asarray(back.topk_text["vllm"]).tolist() == [
        [f"<{i}>" for i in row] if row[0] >= 0 else ["", ""] for row in table.column("vllm_topk_ids").to_pylist()
    ]


def test_ids_unknown_ambiguous_and_malformed(tmp_path):
    store = Store(tmp_path)
    store.save(make_run("abc123"))
    store.save(make_run("abd456"))
    with pytest.raises(UserError, match="ambiguous"):
        store.load("ab")
    with pytest.raises(UserError, match="no stored run"):
        store.load("ffff")
    with pytest.raises(UserError, match="not a run id"):
        store.load("../etc/passwd")
    assert list(store.list_runs()["run_id"]) and set(store.list_runs()["run_id"]) == {"abc123", "abd456"}
    store.delete("abd456")
    assert not store.has("abd456") and not store.path_of("abd456").exists()


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    store = Store(tmp_path)
    import pyarrow.parquet as pq

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", boom)
    with pytest.raises(OSError):
        store.save(make_run())
    assert os.listdir(store.runs_dir) == []
    assert store.list_runs().empty


def test_corrupted_file_is_reported(tmp_path):
    store = Store(tmp_path)
    store.save(make_run())
    path = store.path_of("abc123")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="failed its integrity check"):
        store.load("abc123")
    path.unlink()
    with pytest.raises(UserError, match="no stored run"):  # indexed but gone: not served as complete
        store.load("abc123")


def test_corrupted_index_is_reported(tmp_path):
    Store(tmp_path)
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="not usable"):
        Store(tmp_path)


def test_unwritable_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="not usable"):
        Store(blocker / "sub")


def test_mismatched_ids_are_refused_with_a_typed_engine_error():
    """A typed EngineError (the CLI's exit 3, the page's error box), not a bare AssertionError."""
    from logprob_parity.errors import EngineError, TokenMismatchError

    ids = [1, 2, 3]
    tok = TokenizedText("t", tuple(ids), ("a", "b", "c"), ("a", "b", "c"), False)
    assert issubclass(TokenMismatchError, EngineError)
    with pytest.raises(TokenMismatchError, match="hf scored ids \\[1, 2, 4\\] but the run has \\[1, 2, 3\\]"):
        SequenceResult.build(tok, _scores([1, 2, 4], 0.0), _scores(ids, 0.0))


def test_batch_table_holds_what_sequence_by_sequence_building_holds(tmp_path):
    """The columnar batch builder (logprob_parity.results.positions) and the per-sequence SequenceResult path
    give the same stored positions, summaries and top-k texts, and a run written from two batch
    tables reopens sequence by sequence with every value equal."""
    import pyarrow as pa

    from logprob_parity.results.positions import batch_table, metrics_of

    texts = ("a <b> c", "d\ne f g", "hi")
    toks, hf, vl = [], [], []
    for i, text in enumerate(texts):
        k = max(1, len(text) // 3)
        names = ("<s>", text[:k], text[k : 2 * k], text[2 * k :])
        ids = [1] + [10 + i + j for j in range(len(names) - 1)]
        toks.append(TokenizedText(text, tuple(ids), names, names, True))
        hf.append(_scores(ids, 0.0, gather=True))
        vl.append(_scores(ids, 1e-3 * (i + 1)))
    decode = lambda seqs: [f"<{s[0]}>" for s in seqs]  # noqa: E731
    one = [SequenceResult.build(t, h, v, lambda i: f"<{i}>") for t, h, v in zip(toks, hf, vl)]
    a, a_infos, a_m = batch_table(toks[:2], hf[:2], vl[:2], decode, 0)
    b, b_infos, b_m = batch_table(toks[2:], hf[2:], vl[2:], decode, 2)
    assert [x.summary for x in a_infos + b_infos] == [s.summary for s in one]
    summary = summarize(concat([s.metrics for s in one]))
    assert summarize(concat([metrics_of(a), metrics_of(b)])) == summary == summarize(concat([a_m, b_m]))
    meta = make_run(texts=texts).meta
    import dataclasses

    meta = dataclasses.replace(meta, summary=summary, sequences=tuple(a_infos + b_infos))
    store = Store(tmp_path)
    store.write_run(meta, iter([a, b]))
    back = store.load(meta.run_id)
    for s, r in zip(one, back.sequences):
        assert r.token_ids == s.token_ids and r.tokens == s.tokens and r.pieces == s.pieces
        for side in ("hf", "vllm"):
            for f in ("logprob", "rank", "topk_ids", "topk_logprobs"):
                np.testing.assert_array_equal(getattr(getattr(r, side), f), getattr(getattr(s, side), f))
            assert np.asarray(r.topk_text[side]).tolist() == [list(x) for x in s.topk_text[side]]
        np.testing.assert_array_equal(r.metrics.delta, s.metrics.delta)
        np.testing.assert_array_equal(r.hf.gathered_logprobs, s.hf.gathered_logprobs)
    assert isinstance(pa.table({"x": [1]}), pa.Table)


def test_a_large_run_reopens_one_sequence_without_reading_the_rest(tmp_path, monkeypatch):
    """Row groups bound what opening one prompt reads: with 4-row groups, opening sequence 5 reads
    only the groups that hold its rows, and the values are the stored ones."""
    import logprob_parity.results.store as store_mod
    from logprob_parity.results.run import StoredSequences

    monkeypatch.setattr(store_mod, "ROW_GROUP", 4)
    run = make_run(texts=tuple(f"text number {i}" for i in range(8)))
    store = Store(tmp_path)
    store.save(run)
    back = store.load(run.run_id)
    assert isinstance(back.sequences, StoredSequences) and len(back.sequences) == 8
    s = back.sequences[5]
    assert s.text == "text number 5" and s.token_ids == run.sequences[5].token_ids
    np.testing.assert_array_equal(s.vllm.logprob, run.sequences[5].vllm.logprob)
    assert set(back.sequences._groups) == {5}  # rows 20-23 of 4-row groups: group 5 alone
    assert back.sequences[-1].text == "text number 7"


def test_json_written_a_sequence_at_a_time_is_the_whole_object(tmp_path):
    """`Run.write_json` (streamed, for large sets) holds exactly to_json_dict(): the same text as
    json.dumps without an indent, the same object with one (a sequence a line)."""
    import io
    import json

    run = make_run(texts=("a b c d", "e f g", "h i"))
    for indent in (1, None):
        buf = io.StringIO()
        run.write_json(buf, indent=indent)
        assert json.loads(buf.getvalue()) == json.loads(json.dumps(run.to_json_dict(), allow_nan=False))
        if indent is None:
            assert buf.getvalue() == json.dumps(run.to_json_dict(), allow_nan=False)


def test_a_rollouts_rows_in_chunks_rebuild_every_sample_in_shuffled_order():
    """A rollout is written a few thousand samples at a time (Rollout.tables) and read back by one
    sort and a cut at each sample's bounds (Rollout.from_frame): chunks of any size give the rows of
    the whole, and samples come back with their ids, pieces and values even when the stored rows are
    shuffled and some samples are empty."""
    from types import SimpleNamespace

    import pandas as pd
    import pyarrow as pa

    from logprob_parity.results.rollout import COLUMNS, EXACT, INFO_COLUMNS, Rollout, Sample

    rng = np.random.default_rng(1)
    samples = []
    for i in range(9):
        n = int(rng.integers(0, 6))
        samples.append(
            Sample(
                prompt_index=i // 2,
                seed=i,
                prompt_token_ids=(1, 2),
                completion_token_ids=tuple(int(x) for x in rng.integers(0, 50, n)),
                pieces=tuple(f"p{i}.{t} é🎉" for t in range(n)),
                finish_reason=f"r{i}",
                logprob={c: rng.normal(size=n) for c in COLUMNS},
                exact={c: rng.normal(size=n) for c in EXACT},
            )
        )
    ro = Rollout(meta=SimpleNamespace(samples=[x.info() for x in samples]), samples=tuple(samples))
    whole = ro.to_frame()
    assert len(whole) == sum(len(x.completion_token_ids) for x in samples)
    for per in (1, 2, 4, 100):
        stored = pa.concat_tables(list(ro.tables(per))).to_pandas().drop(columns=list(INFO_COLUMNS))
        pd.testing.assert_frame_equal(stored, whole.drop(columns=["band"]))  # the band is read, not stored
    back = Rollout.from_frame(ro.meta, whole.sample(frac=1.0, random_state=0))
    for a, b in zip(samples, back.samples):
        assert (a.completion_token_ids, a.pieces, a.prompt_index, a.seed) == (
            b.completion_token_ids,
            b.pieces,
            b.prompt_index,
            b.seed,
        )
        for c in COLUMNS:
            np.testing.assert_array_equal(a.logprob[c], b.logprob[c])
        for c in EXACT:
            np.testing.assert_array_equal(a.exact[c], b.exact[c])


def test_the_worst_tokens_and_sequences_are_found_in_one_pass_as_one_sample_at_a_time_finds_them():
    """Rollout.worst_tokens and worst_sequences (the Rollout page's lists, on rescores of 100,000
    sequences) rank as a per-sample scan ranks: largest |Δ| first, a NaN token last, an empty sample
    counted with 0 tokens, each row's values those of its sample and position."""
    from types import SimpleNamespace

    from logprob_parity.results.rollout import COLUMNS, PAIRS, Rollout, Sample

    rng = np.random.default_rng(5)
    samples = []
    for i, n in enumerate([4, 0, 7, 4, 1, 7, 3]):
        lp = {c: -rng.random(n) * 3 for c in COLUMNS}
        if i == 2:
            lp["hf"][3] = np.nan  # a token without HF's value
        samples.append(Sample(i, i, (1,), tuple(range(100 + i, 100 + i + n)), tuple(f"t{i}.{t}" for t in range(n)), f"r{i}", lp))
    ro = Rollout(meta=SimpleNamespace(samples=[x.info() for x in samples]), samples=tuple(samples))
    for pair, (a, _b, _) in PAIRS.items():
        flat = [(i, t, float(x.delta(pair)[t])) for i, x in enumerate(samples) for t in range(len(x.completion_token_ids))]
        want = sorted(flat, key=lambda r: -1.0 if np.isnan(r[2]) else -abs(r[2]))[:6]  # stable: sample, then position
        got = ro.worst_tokens(pair, 6)
        assert [(int(r.sample), int(r.position)) for r in got.itertuples()] == [(i, t) for i, t, _ in want]
        for r in got.to_dict("records"):
            x = samples[r["sample"]]
            assert r["token"] == x.pieces[r["position"]] and r["token_id"] == x.completion_token_ids[r["position"]]
            assert r[a] == x.logprob[a][r["position"]] and r["ratio"] == np.exp(-r["delta"])
        seqs = ro.worst_sequences(pair, 10)
        sums = [-float(x.delta(pair)[np.isfinite(x.delta(pair))].sum()) for x in samples]
        assert seqs["sample"].tolist() == sorted(range(len(samples)), key=lambda i: -abs(sums[i]))
        for r in seqs.to_dict("records"):
            assert r["seq_log_ratio"] == pytest.approx(sums[r["sample"]], rel=1e-15, abs=1e-15)
            assert r["tokens"] == int(np.isfinite(samples[r["sample"]].delta(pair)).sum())
        assert seqs.loc[seqs["sample"] == 1, "largest |Δ|"].isna().all()  # the empty sample
    assert ro.worst_tokens("decode_vs_hf", 100)["delta"].isna().tolist()[-1]  # NaN ranks last


def test_a_run_prints_one_line_and_carries_the_pages_verdict(home):
    """Item 7 of the first hour: print(runs) dumped about 10 KB, and a Run had no verdict. A run read
    through the Python API carries the verdict the pages show, in their words, and prints as one line."""
    import logprob_parity as lp
    from logprob_parity.analysis.verdict import LEVELS, run_verdicts

    run = make_run("5eed0001")
    Store(home).save(run)
    assert run.verdict is None and "no verdict stored" in repr(run)  # made without one
    back = lp.load("5eed0001", home=str(home))
    page = run_verdicts([back])[0]  # what the Compare page and the CLI show
    v = back.verdict
    assert v.level in LEVELS and (v.level, v.headline, v.reasons) == (page.level, page.headline, page.reasons)
    assert str(v) == f"{page.title}: {page.headline}"
    line = repr(back)
    assert "\n" not in line and len(line) < 200, line
    assert line.startswith("Run(5eed0001") and back.meta.model in line and "float32" in line and page.title in line
    assert f"{back.summary['mean_abs_delta']:.3e}" in line and f"{back.summary['max_abs_delta']:.3e}" in line
    assert len(repr([back, back])) < 400


def test_a_partial_character_token_shows_its_bytes_in_show_and_the_report(home, tmp_path, capsys):
    """Item 11 of the first hour: a token holding part of a character (it adds no text) printed as ''
    in `show`'s and the report's worst-token tables; they now give the tokenizer's spelling of it."""
    import dataclasses

    from logprob_parity.cli import main
    from logprob_parity.present.labels import token_shown
    from logprob_parity.present.report import report_html

    base = make_run("9a7b0001", texts=("日本",))
    ids = [1, 227, 151, 10]
    tok = TokenizedText("日本", tuple(ids), ("<s>", "<0xE6>", "<0x97>", "本"), ("<s>", "", "", "日本"), True)
    seq = SequenceResult.build(tok, _scores(ids, 0.0, gather=True), _scores(ids, 0.3))
    info = dataclasses.replace(base.meta.sequences[0], n_positions=4, summary=seq.summary)
    meta = dataclasses.replace(base.meta, summary=summarize(concat([seq.metrics])), sequences=(info,))
    run = Run(meta=meta, sequences=(seq,))
    Store(home).save(run)
    assert main(["show", "9a7b0001"]) == 0
    out = capsys.readouterr().out
    assert "part of a character: <0xE6>" in out and "part of a character: <0x97>" in out and " '' " not in out
    page = report_html([Store(home).load("9a7b0001")])
    assert "part of a character: &lt;0xE6&gt;" in page and "<td class='l'>''</td>" not in page
    assert token_shown(" capital", "Ġcapital") == "' capital'"
