"""Non-ASCII text reads as written in the token view: emoji, Arabic, Hebrew and CJK, with the demo
model's byte-level BPE tokenizer (whose raw pieces look like 'ĠðŁį')."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from test_store import _scores

from logprob_parity.inputs.tokens import load_tokenizer, tokenize
from logprob_parity.present.render import token_view_html
from logprob_parity.results.records import RunMeta
from logprob_parity.results.run import Run, SequenceResult

TEXTS = [
    "Pizza 🍕 is great! 🎉👍🏽",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם, מה שלומך?",
    "你好，世界。今天天气很好。",
    "Mixed: café ☕ عربي עברית 日本語 👩‍👩‍👧",
]


class Spans(HTMLParser):
    """The visible text of each token span (its tooltip child apart), with its classes and tooltip text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tokens: list[dict] = []
        self.depth_in_tip = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if self.depth_in_tip:
            self.depth_in_tip += 1
        elif "lpp-tip" in cls:
            self.depth_in_tip = 1
        elif "lpp-tok" in cls:
            self.tokens.append({"classes": cls, "tip": "", "text": ""})

    def handle_endtag(self, tag):
        if self.depth_in_tip:
            self.depth_in_tip -= 1

    def handle_data(self, data):
        if self.tokens:
            self.tokens[-1]["tip" if self.depth_in_tip else "text"] += data


def _view(tok) -> list[dict]:
    ids = list(tok.token_ids)
    seq = SequenceResult.build(tok, _scores(ids, 0.0, gather=True), _scores(ids, 1e-3))
    meta = RunMeta.from_dict(
        {
            "run_id": "5c1",
            "model": "demo",
            "revision": None,
            "dtype": "float32",
            "backends": ["hf", "vllm"],
            "settings": {},
            "top_k": 2,
            "bos": "auto",
            "summary": seq.summary,
            "sequences": [{"text": tok.text, "bos_added": tok.bos_added, "summary": seq.summary}],
        }
    )
    parser = Spans()
    parser.feed(token_view_html([Run(meta=meta, sequences=(seq,))], 0))
    return parser.tokens


@pytest.mark.parametrize("text", TEXTS)
def test_displayed_pieces_concatenate_back_to_the_input(demo_model, text):
    tok = tokenize(load_tokenizer(str(demo_model)), text, "auto")
    spans = _view(tok)
    assert len(spans) == len(tok.token_ids)
    shown = "".join(s["text"].replace("↵", "") for s in spans[1:])  # after the BOS
    assert shown == text
    raw = {"Ġ", "Ċ", "ð", "Ø", "×", "ä", "ï"}  # byte-level BPE spellings must never be shown
    for s in spans[1:]:
        assert not (set(s["text"]) & raw - set(text)), s
        header = s["tip"].splitlines()[0]
        assert not (set(header.split("id")[0]) & raw - set(text)), header
    partial = [s for s in spans if "lpp-partial" in s["classes"]]
    for s in partial:  # part of a character: no text of its own, still a hoverable span with a tooltip
        assert s["text"] == "" and "part of a character that a later token completes" in s["tip"]
    if any(ord(c) > 0xFFFF for c in text):  # emoji span several byte-level tokens
        assert partial


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_in_linear_time_equal_the_exact_pieces(demo_model, tiny_bos, text):
    """Every token's piece (decode_pieces: a window a token, decoded in one batch) is exactly what
    decoding every prefix gives (exact_pieces), for emoji, RTL and CJK text, for a whole text and for
    a rollout's completion (decode_tail_pieces), whatever token it starts at and wherever it is cut
    (inside a character too), with the demo model's byte-level BPE and the tiny Llama's tokenizer."""
    from logprob_parity.inputs.tokens import decode_pieces, decode_tail_pieces, exact_pieces

    for model in (demo_model, tiny_bos):
        tok = load_tokenizer(str(model))
        ids = tok(text * 4)["input_ids"]
        assert decode_pieces(tok, ids) == exact_pieces(tok, ids)
        for cut in (len(ids), len(ids) - 1, len(ids) - 2):
            for start in (1, 3, len(ids) // 2):
                assert decode_tail_pieces(tok, ids[:cut], start) == exact_pieces(tok, ids[:cut])[start:], (model, cut, start)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_and_token_texts_of_a_gguf_style_tokenizer_are_its_raw_decode(demo_model, text):
    """transformers' GGUF conversion gives a tokenizer a Sequence decoder and clean-up of spaces
    (" ." -> "."). Its pieces still come from the byte-level path and equal the exact pieces of its
    raw decode, so they join to the text its tokens hold, and its one-token texts (the top-k
    column) are that raw decode too: the clean-up never moves a space out of a token."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    from logprob_parity.inputs.tokens import _byte_level_pieces, batch_decoder, decode_pieces, exact_pieces

    tok = AutoTokenizer.from_pretrained(str(demo_model), clean_up_tokenization_spaces=True)
    tok._tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    ids = tok(text + " , and . so on")["input_ids"]
    assert _byte_level_pieces(tok, ids) is not None
    pieces = decode_pieces(tok, ids)
    assert pieces == exact_pieces(tok, ids)
    assert "".join(pieces) == tok.decode(ids, clean_up_tokenization_spaces=False)
    assert "".join(pieces).endswith(" , and . so on")
    singles = batch_decoder(tok)([[i] for i in ids])
    assert singles == [tok.decode([i], clean_up_tokenization_spaces=False) for i in ids]
    assert " ." in singles and " ," in singles


def test_a_whole_array_of_ids_gets_each_tokens_own_text(demo_model):
    """The top-k columns' texts, looked up for an array of ids at once (Decoder.texts_of_ids), are
    each id's own raw decode, in place, "" where there is no id (-1): across calls that bring new ids
    (the table grows), repeated ids, special tokens, and ids seen before through the list call. A token
    that holds part of a character shows its bytes instead of "\ufffd", so candidates read apart."""
    import numpy as np
    from transformers import AutoTokenizer

    from logprob_parity.inputs.tokens import batch_decoder, raw_decode, token_bytes_words

    def shown(i: int) -> str:
        text = raw_decode(tok, [i])
        return token_bytes_words(tok, i) if "\ufffd" in text else text

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    dec = batch_decoder(tok)
    assert dec([[5], [17]]) == [raw_decode(tok, [5]), raw_decode(tok, [17])]
    rng = np.random.default_rng(3)
    for top in (40, 2000, len(tok)):  # each call reaches further into the vocabulary
        ids = rng.integers(-1, top, size=(50, 5))
        ids[0] = [5, 17, 5, -1, tok.eos_token_id]
        got = dec.texts_of_ids(ids).to_pylist()
        want = ["" if i < 0 else shown(int(i)) for i in ids.reshape(-1)]
        assert got == want, [(i, g, w) for i, g, w in zip(ids.reshape(-1), got, want) if g != w][:5]
    # a second decoder on the same tokenizer reads the same texts (kept on the tokenizer, per process)
    assert batch_decoder(tok).texts_of_ids(np.array([[17, -1]])).to_pylist() == [raw_decode(tok, [17]), ""]
    # the pieces of an emoji: each alone decodes to "\ufffd"; as candidates each reads as its own bytes
    parts = tok("🍕", add_special_tokens=False)["input_ids"]
    partial = [i for i in parts if "\ufffd" in raw_decode(tok, [i])]
    assert partial, parts
    texts = dec.texts_of_ids(np.array([partial])).to_pylist()
    assert all(t.startswith("<0x") and "\ufffd" not in t for t in texts), texts
    assert b"".join(bytes(int(h, 16) for h in t[3:-1].split("><0x")) for t in texts).decode() in "🍕", texts
