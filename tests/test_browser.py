"""A real browser (Debian's Chromium through Playwright) against `streamlit run`, real engines."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import cli_env
from hostile import HOSTILE as HOSTILE_STRINGS
from test_hostile import hostile_run

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
HOSTILE = "Thou art <script>alert(1)</script> and <img src=x onerror=alert(1)> lovely."

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (scripts/setup.sh --test installs it)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def server(home):
    port = _free_port()
    log = open(home / "streamlit.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(REPO / "dashboard" / "app.py"), "--server.port", str(port),
         "--server.headless", "true", "--server.address", "127.0.0.1"],
        cwd=REPO, env=cli_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("streamlit did not start: " + (home / "streamlit.log").read_text()[-2000:])
    yield url
    os.killpg(proc.pid, 15)  # the app's engine workers live in its process group
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
    log.close()


def settled(page, timeout_ms: int = 120_000) -> None:
    """Wait until Streamlit has finished running the script for this page (a condition, not a sleep)."""
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=timeout_ms)


def _tokens(page):
    """(style, tooltip text) of each token of the first row."""
    return page.locator(".lpp-row").first.locator(".lpp-tok").evaluate_all(
        "els => els.map(e => [e.getAttribute('style') || '', e.querySelector('.lpp-tip')?.textContent || ''])")


@pytest.mark.engine
def test_compare_in_the_browser_and_share(server, tiny_bos):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    dialogs = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(server)
        page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
        page.get_by_test_id("stSelectbox").first.click()
        page.get_by_role("option", name="Other (Hub id or local folder)").click()
        page.get_by_role("textbox", name="Hub id or local folder").fill(str(tiny_bos))
        page.get_by_role("textbox", name="Text").fill(HOSTILE)
        page.get_by_text("bfloat16", exact=True).click()  # float32 only: one engine pair
        page.get_by_role("button", name="Run", exact=True).click()
        page.locator(".lpp-tok").first.wait_for(timeout=600_000)
        settled(page)

        toks = _tokens(page)
        scored = [(style, title) for style, title in toks if "background:rgb" in style]
        assert len(scored) >= 10 and len(scored) == len(toks) - 1  # all but position 0 coloured
        for _, title in scored:
            assert "HF    logprob" in title and "vLLM  logprob" in title and "rank" in title
        shown = page.locator(".lpp-row .lpp-text").first.inner_text()
        assert "<script>alert(1)</script>" in shown and "<img src=x onerror=alert(1)>" in shown
        assert page.locator(".lpp-tv script, .lpp-tv img").count() == 0
        page.screenshot(path=str(ARTIFACTS / "browser-compare.png"), full_page=True)

        share = page.get_by_role("textbox", name="Share this view").first.input_value()
        assert "runs=" in share
        other = browser.new_context().new_page()
        other.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        other.goto(share)
        other.locator(".lpp-tok").first.wait_for(timeout=60_000)
        settled(other)
        assert [tuple(t) for t in _tokens(other)] == [tuple(t) for t in toks]
        assert "from the store" in other.get_by_test_id("stCaptionContainer").all_inner_texts().__str__()
        assert "computed now, in" in page.get_by_test_id("stCaptionContainer").all_inner_texts().__str__()
        other.screenshot(path=str(ARTIFACTS / "browser-shared.png"), full_page=True)
        browser.close()
    assert dialogs == []


COUNT_EXECUTIONS = """
window.__execs = 0;
for (const f of ['alert', 'confirm', 'prompt', 'print']) { window[f] = () => { window.__execs += 1; }; }
"""


def _check_page(page, dialogs):
    for tok in page.locator(".lpp-tok").all()[:60]:  # hover: fires any mouse handlers a token might carry
        tok.hover()
    assert page.evaluate("window.__execs") == 0 and dialogs == []
    assert page.locator(".lpp-tv script, .lpp-tv img, .lpp-tv iframe, .lpp-tv svg, .lpp-tv a, .lpp-tv object").count() == 0
    shown = page.locator(".lpp-row .lpp-text").first.inner_text()
    for s in HOSTILE_STRINGS:
        if s.startswith("<") and len(s) < 200:
            assert s in shown, s


def test_hostile_text_never_executes(server, home, tmp_path):
    """53 hostile strings as tokens, in the dashboard (a shared link) and in the HTML report."""
    from playwright.sync_api import sync_playwright

    from core.present.report import write_html_report
    from core.results.store import Store

    run = hostile_run()
    Store(home).save(run)
    report = tmp_path / "hostile.html"
    write_html_report(run, report)
    dialogs = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for url in (f"{server}/?runs={run.run_id}", report.as_uri()):
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.add_init_script(COUNT_EXECUTIONS)
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(url)
            page.locator(".lpp-tok").first.wait_for(timeout=60_000)
            if url.startswith("http"):
                settled(page)
            _check_page(page, dialogs)
            page.close()
        browser.close()
