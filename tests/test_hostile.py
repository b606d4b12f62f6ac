"""Hostile text through the tokenizer, the token view and tooltips, tables, uploads and the report."""

import json
from html.parser import HTMLParser

import pytest
from test_store import make_run

from logprob_parity.inputs.prompts import parse_prompts
from logprob_parity.inputs.tokens import load_tokenizer, tokenize
from logprob_parity.present.render import token_view_html
from logprob_parity.present.report import report_html

from hostile import HOSTILE

VIEW_TAGS = {"style", "div", "span", "b"}
VIEW_ATTRS = {"class", "style", "data-index", "data-value", "data-scale", "data-band"}
DANGEROUS_TAGS = {
    "script",
    "img",
    "iframe",
    "object",
    "embed",
    "a",
    "link",
    "base",
    "form",
    "input",
    "video",
    "source",
    "details",
    "marquee",
    "math",
    "noscript",
    "textarea",
    "body",
}


class Tags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.attrs, self.tips = [], [], []
        self._in_tip = 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)
        if self._in_tip:
            self._in_tip += 1
        elif ("class", "lpp-tip") in attrs:
            self._in_tip = 1
            self.tips.append("")

    def handle_endtag(self, tag):
        if self._in_tip:
            self._in_tip -= 1

    def handle_data(self, data):
        if self._in_tip:
            self.tips[-1] += data


def parse(html_text):
    p = Tags()
    p.feed(html_text)
    return p


def hostile_run(run_id="0badc0de"):
    return make_run(run_id, texts=("".join(HOSTILE),), pieces=[HOSTILE])


def test_every_hostile_string_survives_storage_and_json_unchanged(home):
    """The product keeps each of the 50+ hostile strings exactly: stored, reopened and exported."""
    import json

    from logprob_parity.results.store import Store

    assert len(HOSTILE) >= 50 and len(set(HOSTILE)) == len(HOSTILE)
    run = hostile_run("beefbeef")
    Store(home).save(run)
    back = Store(home).load(run.run_id)
    assert back.sequences[0].pieces[1:] == tuple(HOSTILE)
    exported = json.loads(json.dumps(back.to_json_dict()))
    assert exported["sequences"][0]["tokens"][1:] == list(HOSTILE)


def test_token_view_and_tooltips_hold_only_our_markup():
    view = token_view_html([hostile_run()], 0)
    p = parse(view)
    assert set(p.tags) <= VIEW_TAGS, set(p.tags) - VIEW_TAGS
    assert {name for name, _ in p.attrs} <= VIEW_ATTRS
    classes = [v for name, v in p.attrs if name == "class"]
    assert sum(c.startswith("lpp-tok") for c in classes) == len(HOSTILE) + 1  # one span per token, BOS included
    assert classes.count("lpp-tip") == len(HOSTILE) + 1  # and one tooltip each
    # every string is there to read: the tooltips name each token exactly, as text
    assert len(p.tips) == len(HOSTILE) + 1
    for s, tip in zip(HOSTILE, p.tips[1:]):
        assert repr(s) in tip


def test_report_holds_no_active_content():
    page = report_html([hostile_run()])
    p = parse(page)
    assert p.tags.count("body") == 1  # our own
    assert not set(p.tags) & (DANGEROUS_TAGS - {"body"}), set(p.tags) & DANGEROUS_TAGS
    assert not [name for name, _ in p.attrs if name.startswith("on")]
    assert not [v for name, v in p.attrs if name in ("href", "src") and v]


def test_uploads_keep_every_string(tmp_path):
    data = "\n".join(json.dumps({"text": s}) for s in HOSTILE).encode()
    assert parse_prompts(data, "h.jsonl").texts == tuple(HOSTILE)
    csv = "text\n" + "\n".join(json.dumps(s) for s in HOSTILE if "\n" not in s and "\r" not in s and '"' not in s)
    assert len(parse_prompts(csv.encode(), "h.csv").texts) >= 40


@pytest.mark.parametrize("text", HOSTILE)
def test_the_real_tokenizer_rebuilds_each_string(tiny_nobos, text):
    tok = tokenize(_tokenizer(tiny_nobos), text, "none")
    assert "".join(tok.pieces) == text  # readable, byte for byte, however it was split


_TOK = {}


def _tokenizer(path):
    if path not in _TOK:
        _TOK[path] = load_tokenizer(str(path))
    return _TOK[path]
