"""A live demo with no traps, in Chromium (issue: a newcomer's tour found each of these):
- a typed Hub id is the model that runs, or it is refused in words; the preset never runs in its place;
- an error is in view without scrolling, at the common laptop window sizes;
- under a prompt of a set, that prompt's own verdict and numbers;
- Delete asks first, says what it deleted, and leaves no row ticked.
None of these needs an engine: the refusals come before any starts, the rest opens stored results."""

from __future__ import annotations

import os

import pytest
from test_store import make_run

from logprob_parity.dashboard.components.run_view import card_number
from logprob_parity.results.store import Store

from test_browser import CHROMIUM, CHROMIUM_ARGS, server, settled, stored_page  # noqa: F401 - server is a fixture

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed"),
]
TYPED = "nonexistent-org/this-model-does-not-exist-123"
# An alert holding this text lies wholly inside the window (a condition to wait on: the page scrolls it there).
IN_VIEW = """(text) => { const e = [...document.querySelectorAll('[data-testid="stAlertContainer"]')]
                           .find(x => x.innerText.includes(text));
                         if (!e) return false; const r = e.getBoundingClientRect();
                         return r.top >= 0 && r.bottom <= window.innerHeight; }"""


def _in_view(page, locator) -> bool:
    box, view = locator.bounding_box(), page.viewport_size
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= view["height"]


def test_an_error_is_in_view_without_scrolling_at_laptop_sizes(server):
    from playwright.sync_api import expect

    for width, height in ((1400, 900), (1440, 900), (1280, 800)):
        with stored_page(server, "demo-traps") as (page, out):
            page.set_viewport_size({"width": width, "height": height})
            page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
            settled(page)
            page.get_by_role("textbox", name="Text").fill("")
            page.get_by_role("button", name="Run", exact=True).click()
            error = page.get_by_test_id("stAlertContainer").filter(has_text="empty")
            expect(error).to_be_visible(timeout=60_000)
            page.wait_for_function(IN_VIEW, arg="empty", timeout=10_000)
            page.screenshot(path=str(out / f"error-in-view-{width}x{height}.png"))
            assert _in_view(page, error.first), (width, height, error.first.bounding_box())


def test_a_typed_hub_id_is_refused_in_words_and_the_preset_never_runs_in_its_place(server, home):
    from playwright.sync_api import expect

    with stored_page(server, "demo-traps") as (page, out):
        page.set_viewport_size({"width": 1400, "height": 900})
        page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
        settled(page)
        # the preset above stays on the demo model (its default); only the field is typed into
        page.get_by_role("textbox", name="Hub id or local folder").fill(TYPED)
        page.get_by_role("button", name="Run", exact=True).click()
        error = page.get_by_test_id("stAlertContainer").filter(has_text=TYPED)
        expect(error).to_be_visible(timeout=300_000)
        settled(page, 300_000)
        page.wait_for_function(IN_VIEW, arg=TYPED, timeout=10_000)
        page.screenshot(path=str(out / "typed-hub-id-refused.png"))
        assert _in_view(page, error.first)
        # the status line named the typed model, not the preset
        assert TYPED in page.get_by_test_id("stExpander").filter(has_text="Could not run").first.inner_text()
        body = page.get_by_test_id("stMain").inner_text()
        assert "Result: demo" not in body and page.locator(".lpp-tok").count() == 0
        assert Store(home).list_runs().empty  # nothing ran, nothing stored


def test_a_prompt_of_a_set_shows_its_own_numbers_under_its_heading(server, home):
    texts = ("first prompt, small gaps", "second prompt, larger gaps", "third prompt, the largest gaps 🌊 مرحبا 海")
    run = make_run("5e7001", texts=texts)
    Store(home).save(run)
    with stored_page(f"{server}/prompt-set?runs=5e7001&seq=0", "demo-traps") as (page, out):
        from playwright.sync_api import expect

        page.get_by_text("Prompt 1 of 3", exact=False).wait_for(timeout=60_000)
        settled(page)
        own = card_number(run.meta.sequences[0].summary["max_abs_delta"])
        whole = card_number(run.summary["max_abs_delta"])
        assert own != whole
        # wait on the card itself: on a loaded machine the heading can be drawn a moment before its cards
        card = page.get_by_test_id("stMetric").filter(has_text="largest gap")
        try:
            expect(card).to_have_count(1, timeout=60_000)
        except AssertionError as e:  # say what the page showed instead
            raise AssertionError(page.get_by_test_id("stMain").inner_text()[:3000]) from e
        finally:
            page.screenshot(path=str(out / "prompt-own-numbers.png"), full_page=True)
        largest = card.all_inner_texts()
        assert own in largest[0] and whole not in largest[0], (own, whole, largest)
        assert page.get_by_text("The whole set: all 3 prompts", exact=False).count() == 1


def test_delete_asks_first_then_says_what_it_deleted_and_no_row_stays_ticked(server, home):
    from playwright.sync_api import expect

    store = Store(home)
    store.save(make_run("de1e7e", texts=("delete me مرحبا",), created_ts=2.0))  # the newest: the first row; ends right-to-left
    store.save(make_run("4ee900", texts=("keep me",), created_ts=1.0))
    with stored_page(f"{server}/runs", "demo-traps") as (page, out):
        grid = page.get_by_test_id("stDataFrame").first
        grid.wait_for(timeout=60_000)
        settled(page)
        box = grid.bounding_box()
        page.mouse.click(box["x"] + 12, box["y"] + 35 + 17)  # the first row's tick box: "delete me", the newest
        delete = page.get_by_role("button", name="Delete selected")
        expect(delete).to_be_enabled(timeout=30_000)
        delete.click()
        expect(page.get_by_text("cannot be undone", exact=False)).to_be_visible(timeout=30_000)
        settled(page)
        page.screenshot(path=str(out / "delete-asks.png"))
        assert store.has("de1e7e")  # asked, not yet deleted
        page.get_by_role("button", name="Yes, delete").click()
        expect(page.get_by_text("Deleted 1 run", exact=False)).to_be_visible(timeout=30_000)
        settled(page)
        page.screenshot(path=str(out / "delete-said.png"))
        assert not store.has("de1e7e") and store.has("4ee900")
        expect(page.get_by_role("button", name="Delete selected")).to_be_disabled()  # nothing is ticked now
