"""The demo tour, in Chromium, on the real engines and the embedded demo model, as a team demo runs
it: the server starts (engines warming), Compare with emoji/RTL/CJK text, hover, a share link in a
fresh browser, bad inputs, a long text, a prompt set, Diagnostics and the Runs page.

At each stop it checks what a demo audience would trip on: errors visible without a click and no
stale result under them, the form showing what the view shows, the text readable as written,
tooltips inside the viewport, charts with marks in the product's dtype colours, no alert fired.
Screenshots are kept in test-artifacts/tour/ (CI uploads test-artifacts/).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from logprob_parity.dashboard.components.run_view import card_number

from test_browser import CHROMIUM, CHROMIUM_ARGS, docs_shot, settled
from test_browser_server import Dashboard, _choose_model

pytestmark = [
    pytest.mark.browser,
    pytest.mark.engine,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed"),
]

SHOTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "tour"
TEXT = "Pizza 🍕 is great! مرحبا بالعالم. שלום עולם. 你好，世界。 Dave lives in Palm Coast 👍🏽."
LONG = " ".join(["The committee will meet on Thursday to review the budget, and then it will vote."] * 40)
PROMPTS = "The cat sat on the mat.\nمرحبا بالعالم، كيف حالك؟\nShall I compare thee to a summer's day?\n"
VIEW_W, VIEW_H = 1300, 1000


class Tour:
    def __init__(self, page, dialogs: list[str]) -> None:
        self.page, self.dialogs, self.n = page, dialogs, 0

    def shot(self, name: str, page=None, full: bool = False) -> None:
        """A screenshot; `full` grows the viewport to the app's height first (Streamlit scrolls
        inside its own container, so a full-page screenshot alone shows one screen)."""
        self.n += 1
        page = page or self.page
        path = str(SHOTS / f"{self.n:02d}-{name}.png")
        if not full:
            page.screenshot(path=path)
            return
        height = page.evaluate("() => document.querySelector('[data-testid=stMain]')?.scrollHeight || 1000")
        page.set_viewport_size({"width": VIEW_W, "height": min(int(height) + 50, 8000)})
        settled(page)
        page.screenshot(path=path)
        page.set_viewport_size({"width": VIEW_W, "height": VIEW_H})
        settled(page)

    def clean(self, page=None) -> None:
        """No Python exception box and no browser dialog so far."""
        page = page or self.page
        assert page.get_by_test_id("stException").count() == 0
        assert self.dialogs == []


def _watch(page, dialogs: list[str]) -> None:
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))


def _inside_viewport(page, box) -> bool:
    return (
        box is not None
        and box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= VIEW_W
        and box["y"] + box["height"] <= VIEW_H
    )


def _check_tooltip(page, token) -> None:
    """Hovering shows the panel with every line whole, inside the viewport; leaving closes it."""
    token.scroll_into_view_if_needed()
    token.hover()
    tip = token.locator(".lpp-tip")
    tip.wait_for(state="visible")
    assert _inside_viewport(page, tip.bounding_box()), tip.bounding_box()
    assert tip.evaluate("e => e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight")  # nothing cut
    assert "HF top-5:" in tip.inner_text() and "vLLM top-5:" in tip.inner_text()
    page.mouse.move(5, 5)
    tip.wait_for(state="hidden")


def _has_palette_marks(element, colours: list[str], at_least: int = 30) -> bool:
    """A chart has marks: its screenshot holds pixels in the dtype colours of logprob_parity.present.palette."""
    from PIL import Image

    img = Image.open(io.BytesIO(element.screenshot())).convert("RGB")
    want = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in colours]
    hits = sum(1 for px in img.getdata() if any(sum(abs(a - b) for a, b in zip(px, w)) < 40 for w in want))
    return hits >= at_least


def _error_shown(page, text: str) -> None:
    """The message is on screen without a click, and no result from before stays under it."""
    from playwright.sync_api import expect

    expect(page.get_by_test_id("stAlertContentError").filter(has_text=text).first).to_be_visible(timeout=120_000)
    settled(page)
    assert page.locator(".lpp-tok").count() == 0


def test_demo_tour(home):
    from playwright.sync_api import expect, sync_playwright

    from logprob_parity.present.palette import DTYPE_COLOURS

    SHOTS.mkdir(parents=True, exist_ok=True)
    dash = Dashboard(home, LPP_PREWARM="1")
    dialogs: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": VIEW_W, "height": VIEW_H})
            _watch(page, dialogs)
            tour = Tour(page, dialogs)

            # 1. Compare: emoji, Arabic, Hebrew, CJK; the verdict first, in words
            page.goto(dash.url)
            page.get_by_role("textbox", name="Text").wait_for(timeout=120_000)
            settled(page)
            tour.shot("compare-opens")
            page.get_by_role("textbox", name="Text").fill(TEXT)
            page.get_by_role("button", name="Run", exact=True).click()
            page.locator(".lpp-row").nth(1).wait_for(timeout=900_000)
            settled(page, 900_000)
            tour.clean()
            verdicts = page.get_by_test_id("stAlert").filter(
                has_text=re.compile(r"(Match|Small but systematic|Close|Differs)\. (bfloat16|float32):")
            )
            tour.shot("compare-result-top")
            docs_shot(page, "compare")
            assert verdicts.count() == 2, page.get_by_test_id("stAlert").all_inner_texts()  # one per dtype, in words
            assert verdicts.first.bounding_box()["y"] < page.locator(".lpp-tv").bounding_box()["y"]  # before the tokens
            for row in page.locator(".lpp-row .lpp-text").all():
                assert row.inner_text().replace("↵", "").endswith(TEXT)  # reads as written (BOS first)
            legend = page.locator(".lpp-legend").inner_text()
            assert "within HF’s own noise" in legend and "beyond both HF’s noise and vLLM’s tolerance" in legend
            assert "not measured" not in legend and "HF moved 99.5% of" in legend  # the verdict's noise tail, in words
            assert "red from" in legend  # where red starts, and why
            tour.shot("compare-result", full=True)

            # 2. hover: at the left, at the right end of a row, and low on the screen
            toks = page.locator(".lpp-row").nth(1).locator(".lpp-tok")
            for t in (toks.nth(1), toks.nth(toks.count() - 1), page.locator(".lpp-row").nth(0).locator(".lpp-tok").nth(5)):
                _check_tooltip(page, t)
            toks.nth(toks.count() - 1).hover()
            tour.shot("hover-right-edge")
            page.mouse.move(5, 5)

            # 3. charts have marks, in the palette's dtype colours
            page.get_by_role("tab", name="vLLM against HF").click()
            chart = page.locator('[data-testid="stVegaLiteChart"]:visible').first  # the open tab's chart
            chart.scroll_into_view_if_needed()
            expect(chart).to_be_visible()
            assert _has_palette_marks(chart, [DTYPE_COLOURS["bfloat16"], DTYPE_COLOURS["float32"]])
            tour.shot("chart")

            # 4. the share link, in a fresh browser context: same tokens, and the form shows them
            share = page.get_by_role("textbox", name="Share this view").first.input_value()
            other = browser.new_context(viewport={"width": VIEW_W, "height": VIEW_H}).new_page()
            _watch(other, dialogs)
            other.goto(share)
            other.locator(".lpp-row").nth(1).wait_for(timeout=120_000)
            settled(other)
            tour.clean(other)
            # conditions, not reads: the form's widgets take their values from the view as they mount
            try:
                expect(other.get_by_role("textbox", name="Text", exact=True)).to_have_value(TEXT, timeout=30_000)
            except AssertionError:
                tour.shot("shared-link-form-not-filled", page=other, full=True)  # what the reader saw, kept for the log
                raise
            expect(other.get_by_role("checkbox", name="bfloat16", exact=True)).to_be_checked()
            expect(other.get_by_role("checkbox", name="float32", exact=True)).to_be_checked()
            assert "from the store" in " ".join(other.get_by_test_id("stCaptionContainer").all_inner_texts())
            tour.shot("shared-link", page=other)
            other.context.close()

            # 5. bad inputs: each message visible at once, the old result gone
            page.get_by_role("textbox", name="Text").fill("   ")
            page.get_by_role("button", name="Run", exact=True).click()
            _error_shown(page, "is empty")
            tour.shot("error-empty")
            _choose_model(page, "/no/such/folder")
            page.get_by_role("textbox", name="Text").fill(TEXT)
            page.get_by_role("button", name="Run", exact=True).click()
            _error_shown(page, "does not exist")
            tour.shot("error-missing-folder")
            page.get_by_role("textbox", name="Hub id or local folder").fill("nobody-here/no-such-model")
            page.get_by_role("button", name="Run", exact=True).click()
            _error_shown(page, "unknown model")
            tour.shot("error-unknown-hub-id")
            # back to the demo model: the preset above never changed, so emptying the field is all it takes
            page.get_by_role("textbox", name="Hub id or local folder").fill("")
            page.get_by_role("textbox", name="Text").fill("word " * 40_000)  # 200 KB, over the model's 8192 positions
            page.get_by_role("button", name="Run", exact=True).click()
            _error_shown(page, "tick 'Truncate prompts longer than the model's positions'")
            tour.shot("error-too-long")

            # 6. a long text: shown a window at a time, the worst part first
            page.get_by_role("textbox", name="Text").fill(LONG)
            page.get_by_text("bfloat16", exact=True).click()  # float32 only
            page.get_by_role("button", name="Run", exact=True).click()
            page.locator(".lpp-row").first.wait_for(timeout=900_000)
            settled(page, 900_000)
            tour.clean()
            expect(page.get_by_text("it is shown 512 at a time, the part with the largest gap first")).to_be_visible()
            assert page.locator(".lpp-row").first.locator(".lpp-tok").count() <= 512
            tour.shot("long-text")

            # 7. a prompt set: upload, run, click a row to open that prompt
            page.goto(f"{dash.url}/prompt-set")
            page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
            settled(page)
            page.locator('input[type="file"]').set_input_files(
                files=[{"name": "p.txt", "mimeType": "text/plain", "buffer": PROMPTS.encode()}]
            )
            expect(page.get_by_text("3 prompts from p.txt")).to_be_visible(timeout=30_000)
            if page.get_by_role("checkbox", name="bfloat16", exact=True).is_checked():
                page.get_by_text("bfloat16", exact=True).click()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("click a row to open it below", exact=False).first.wait_for(timeout=900_000)
            settled(page, 900_000)
            tour.clean()
            # the table lists the prompt with the largest gap first: the second row is the second largest
            from logprob_parity.results.store import Store

            stored = Store(home).list_runs()
            run = Store(home).load(stored[stored["n_sequences"] == 3]["run_id"].iloc[0])
            by_gap = sorted(range(3), key=lambda i: -run.meta.sequences[i].summary["max_abs_delta"])
            second = by_gap[1]
            grid = page.get_by_test_id("stDataFrame").nth(1)
            grid.scroll_into_view_if_needed()
            box = grid.bounding_box()
            page.mouse.click(box["x"] + box["width"] * 0.4, box["y"] + 35 * 2 + 17)  # a cell of the second row
            expect(page.get_by_text(f"Prompt {second + 1} of 3", exact=False)).to_be_visible(timeout=60_000)
            settled(page)
            # under the prompt's heading, its own numbers: this prompt's largest gap, not the set's
            own = card_number(run.meta.sequences[second].summary["max_abs_delta"])
            largest = " ".join(page.get_by_test_id("stMetric").filter(has_text="largest gap").all_inner_texts())
            assert own in largest, (own, largest)
            assert page.get_by_text("The whole set: all 3 prompts", exact=False).count() == 1
            want = PROMPTS.splitlines()[second]
            assert want.split()[0] in page.locator(".lpp-row .lpp-text").first.inner_text()
            docs_shot(page, "prompt-set")
            tour.shot("prompt-set", full=True)

            # 8. Diagnostics: verdict, noise bars with marks, shares as percentages, words not keys
            page.goto(f"{dash.url}/diagnostics")
            page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
            settled(page)
            page.get_by_role("textbox", name="Text").fill(TEXT)
            if page.get_by_role("checkbox", name="bfloat16", exact=True).is_checked():
                page.get_by_text("bfloat16", exact=True).click()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_test_id("stMetric").first.wait_for(timeout=900_000)  # only a result has metrics (the gap ÷ noise)
            settled(page, 900_000)
            tour.clean()
            body = page.locator("section.main, [data-testid='stMain']").first.inner_text()
            for internal in ("hf_batched", "vllm_repeat", "None", "gap / HF"):
                assert internal not in body, internal
            assert "× HF's own noise" in body and "%" in body
            bars = page.locator('[data-testid="stVegaLiteChart"]:visible').first
            bars.scroll_into_view_if_needed()
            assert _has_palette_marks(bars, [DTYPE_COLOURS["float32"]])
            docs_shot(page, "diagnostics")
            tour.shot("diagnostics", full=True)

            # 9. Runs: one row per comparison; opening it fills the form with its text
            page.goto(f"{dash.url}/runs")
            settled(page)
            tour.clean()
            expect(
                page.get_by_text("comparisons (", exact=False)
            ).to_be_visible()  # one row per comparison (AppTest checks the rows)
            tour.shot("runs", full=True)
            grid = page.get_by_test_id("stDataFrame").first
            box = grid.bounding_box()
            # the newest comparison is the prompt set (it opens on its own page); the one before, the long text
            page.mouse.click(box["x"] + box["width"] * 0.2, box["y"] + 35 * 2 + 17)
            expect(page.get_by_role("button", name="Open selected")).to_be_enabled(timeout=30_000)
            page.get_by_role("button", name="Open selected").click()
            page.locator(".lpp-row").first.wait_for(timeout=60_000)
            settled(page)
            tour.clean()
            shown_text = page.get_by_role("textbox", name="Text").input_value()
            assert shown_text == LONG  # the form shows what the view shows
            drawn = page.locator(".lpp-row .lpp-text").first.inner_text().replace("↵", "").removeprefix("<|im_start|>")
            assert len(drawn) > 100 and drawn in LONG  # the window drawn (512 of its tokens) is part of that text
            tour.shot("runs-opened")
            browser.close()
    finally:
        dash.kill()
    assert dialogs == []
