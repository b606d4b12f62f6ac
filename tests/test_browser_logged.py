"""In a real browser, real engines: rescore a logged rollouts file on the Rollout page and open its worst
token's sequence; pick a comparison's two dtype runs on Runs and read their diff."""

from __future__ import annotations

import json

import pytest

from test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, docs_shot, server, settled  # noqa: F401 - server is a fixture

pytestmark = [pytest.mark.browser, pytest.mark.engine]


def test_rescore_a_logged_file_open_the_worst_token_and_diff_two_runs(server, tiny_bos, home, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from logprob_parity.analysis.compare import compare
    from logprob_parity.inputs.spec import RunSpec
    from logprob_parity.results.store import Store

    f32, _bf16 = compare(
        RunSpec(
            texts=("Shall I compare thee to a summer's day? Thou art more lovely.",),
            model=str(tiny_bos),
            dtypes=("float32", "bfloat16"),
            device="cpu",
        ),
        store=Store(home),
    )
    ids = list(f32.sequences[0].token_ids)
    lps = [float(x) for x in f32.sequences[0].vllm.logprob]
    records = [
        {"prompt_token_ids": ids[:3], "completion_token_ids": ids[3:], "logprobs": lps[3:], "id": "clean"},
        {"prompt_token_ids": ids[:5], "completion_token_ids": ids[5:], "logprobs": lps[5:], "id": "broken"},
    ]
    records[1]["logprobs"][4] -= 3.0  # the worst token: record 2, completion position 4
    body = ("\n".join(json.dumps(r) for r in records) + "\n").encode()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{server}/rollout")
        settled(page)
        page.get_by_role("tab", name="Rescore logged rollouts").click()
        panel = page.get_by_role("tabpanel").filter(has_text="Rescore rollouts you already have")
        panel.locator('input[type="file"]').set_input_files(
            files=[{"name": "steps.jsonl", "mimeType": "application/json", "buffer": body}]
        )
        panel.get_by_role("textbox", name="Hub id or local folder").fill(str(tiny_bos))
        panel.get_by_role("button", name="Rescore").click()
        expect(page.get_by_text("Where the ratio breaks most", exact=False)).to_be_visible(timeout=600_000)
        settled(page, 600_000)
        assert "2 logged sequences from steps.jsonl" in page.locator("[data-testid='stMain']").inner_text()
        page.screenshot(path=str(ARTIFACTS / "rollout-logged.png"), full_page=True)
        grids = page.get_by_test_id("stDataFrame")
        worst = grids.filter(has=page.locator("canvas")).nth(1)  # sequences, then tokens, worst first
        worst.scroll_into_view_if_needed()
        box = worst.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + 35 + 17)  # the first (worst) token's row
        # the worst token's sequence (logged record 2) opens in the coloured view
        expect(page.get_by_text("logged record 2, id broken", exact=False).first).to_be_visible(timeout=60_000)
        settled(page)
        page.screenshot(path=str(ARTIFACTS / "rollout-logged-worst.png"), full_page=True)

        page.goto(f"{server}/runs")
        settled(page)
        grid = page.get_by_test_id("stDataFrame").first
        box = grid.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.2, box["y"] + 35 + 17)  # the comparison with two dtypes
        diff_button = page.get_by_role("button", name="Diff the two selected runs")
        expect(diff_button).to_be_enabled(timeout=30_000)
        diff_button.click()
        try:
            expect(page.get_by_text("widened the mean gap", exact=False)).to_be_visible(timeout=60_000)
        except AssertionError:
            page.screenshot(path=str(ARTIFACTS / "diff-failed.png"), full_page=True)
            raise
        settled(page)
        assert "dtype float32 → bfloat16" in page.locator("[data-testid='stMain']").inner_text()
        page.screenshot(path=str(ARTIFACTS / "diff.png"), full_page=True)
        docs_shot(page, "diff")
        browser.close()
