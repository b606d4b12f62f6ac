"""Store plumbing on synthetic scores (no engine): round trip, atomicity, ids, listing."""

import os

import numpy as np
import pytest

from core.errors import UserError
from core.analysis.metrics import concat, summarize
from core.results.records import RunMeta
from core.results.run import Run, SequenceResult
from core.results.scores import TokenScores
from core.results.store import Store
from core.inputs.tokens import TokenizedText


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
        "run_id": run_id, "created": "2026-12-02T00:00:00+00:00", "created_ts": 1.0, "model": "m", "model_path": "/m",
        "revision": None, "model_identity": {}, "dtype": dtype, "backends": ["hf", "vllm"], "settings": {},
        "top_k": 2, "bos": "auto", "device": "cpu", "env": {"device": "cpu", "torch": "t", "transformers": "tf", "vllm": "v"}, "summary": summary,
        "sequences": [{"text": s.text, "bos_added": True, "n_positions": len(s.token_ids), "summary": s.summary, "cut_from": cut_from}
                      for s in seqs],
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

    monkeypatch.setattr(pq, "write_table", boom)
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
    from core.errors import EngineError, TokenMismatchError

    ids = [1, 2, 3]
    tok = TokenizedText("t", tuple(ids), ("a", "b", "c"), ("a", "b", "c"), False)
    assert issubclass(TokenMismatchError, EngineError)
    with pytest.raises(TokenMismatchError, match="hf scored ids \\[1, 2, 4\\] but the run has \\[1, 2, 3\\]"):
        SequenceResult.build(tok, _scores([1, 2, 4], 0.0), _scores(ids, 0.0))
