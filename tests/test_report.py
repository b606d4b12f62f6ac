"""The self-contained HTML report: everything inline, hostile text shown as text."""

import html
import re

from test_store import make_run

from logprob_parity.present.render import token_view_html
from logprob_parity.present.report import write_html_report

HOSTILE = '<script>alert(1)</script> <img src=x onerror=alert(1)> " onmouseover="alert(1)'


def test_report_is_self_contained_and_escaped(tmp_path):
    run = make_run("cafe01", texts=(HOSTILE, "plain text here"))
    out = tmp_path / "r.html"
    write_html_report(run, out)
    page = out.read_text()
    # nothing fetched from elsewhere: no external scripts, styles or images
    assert not re.search(r"<(script|link|img|iframe)\b", page, re.I)
    assert not re.search(r"(src|href)\s*=\s*[\"']?https?:", page, re.I)
    assert "<svg" in page  # charts inline as SVG
    assert html.escape(HOSTILE, quote=True) in page  # the prompt, shown as text
    assert "alert(1)</script>" not in page
    from logprob_parity.present.labels import summary_label

    for key in run.summary:  # every summary figure, named in words
        assert html.escape(summary_label(key), quote=True) in page


def test_token_view_escapes_every_piece_and_tooltip():
    run = make_run("cafe02", texts=(HOSTILE,))
    view = token_view_html([run], 0)
    assert "<script" not in view and "<img" not in view
    # every attribute value is quoted and free of raw quotes from the text; tooltips are escaped text
    for value in re.findall(r'="([^"]*)"', view):
        assert "<" not in value
    for tip in re.findall(r'<span class="lpp-tip">(.*?)</span>', view, re.S):
        assert "<" not in tip and '"' not in tip
