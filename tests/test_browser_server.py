"""The dashboard as a server, as `logprob-parity dashboard` starts it: its model-root rules on every
page, three users at once under an engine cap, and a clean stop on SIGTERM. Engines here are the
fake backend (real host processes, no model), so these tests take seconds to a minute."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import cli_env

import test_browser
from test_browser import CHROMIUM, CHROMIUM_ARGS, _free_port, settled

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"

pytestmark = test_browser.pytestmark


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def hosts_of(pid: int, spares: bool = True) -> list[int]:
    """Engine host processes started by process `pid` (they carry LPP_HOST_PARENT=pid); spares=False
    leaves out the spares (started with --spare: imports done, waiting for a model after a job)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            spare = b"--spare" in (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LPP_HOST_PARENT={pid}".encode() in env and (spares or not spare):
            found.append(int(entry.name))
    return found


class Dashboard:
    """`python -m logprob_parity.cli dashboard` in its own process group, with this test's store and env."""

    def __init__(self, home: Path, address: str = "127.0.0.1", **env: str) -> None:
        self.port = _free_port()
        self.log = home / f"dashboard-{self.port}.log"
        environment = cli_env(home)
        environment.pop("LPP_MODEL_ROOTS", None)
        environment["LPP_PREWARM"] = "0"  # engines start when a test asks (test_engines_start_with_the_server turns it on)
        environment.update(env)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "logprob_parity.cli",
                    "dashboard",
                    "--headless",
                    "--address",
                    address,
                    "--port",
                    str(self.port),
                ],
                cwd=REPO,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2).read() == b"ok":
                    return
            except OSError:
                time.sleep(0.3)
        self.kill()
        pytest.fail("the dashboard did not start: " + self.log.read_text()[-2000:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _browser(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def _choose_model(page, folder: str) -> None:
    settled(page)
    page.get_by_role("textbox", name="Hub id or local folder").fill(folder)  # a filled field is the model that runs


def test_beyond_localhost_diagnostics_refuse_a_local_folder_visibly(home, tiny_bos):
    """Bound to 0.0.0.0 with no LPP_MODEL_ROOTS: Diagnostics refuses a local model folder with a
    message on screen (no click needed), exactly as Compare does, and nothing is computed."""
    from playwright.sync_api import expect, sync_playwright

    from logprob_parity.results.store import Store

    ARTIFACTS.mkdir(exist_ok=True)
    dash = Dashboard(home, address="0.0.0.0")
    try:
        with sync_playwright() as p:
            browser = _browser(p)
            for path, shot in (("diagnostics", "diagnostics-refuses-folder.png"), ("", "compare-refuses-folder.png")):
                page = browser.new_page(viewport={"width": 1400, "height": 1400})
                page.goto(f"{dash.url}/{path}")
                page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
                _choose_model(page, str(tiny_bos))
                page.get_by_role("button", name="Run", exact=True).click()
                message = page.get_by_text("local model folders are limited on this server; allowed roots: none")
                expect(message).to_be_visible(timeout=60_000)
                settled(page)
                expect(message).to_be_visible()
                page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
                page.close()
            browser.close()
    finally:
        dash.kill()
    assert Store(home).list_runs().empty and Store(home).list_diagnostics().empty


def test_three_users_at_once_under_a_two_engine_cap_all_get_results(home, tiny_bos):
    """LPP_MAX_WARM_ENGINES=2, three tabs press Run at once with one dtype each: two wait in line
    (one for more than 30 s) and say so, and all three end with coloured tokens and no error."""
    from playwright.sync_api import sync_playwright

    dash = Dashboard(home, LPP_FAKE_ENGINES="1", LPP_FAKE_SCORE_S="1", LPP_MAX_WARM_ENGINES="2")
    clicks = {"float16": ["float16", "bfloat16", "float32"], "bfloat16": ["float32"], "float32": ["bfloat16"]}
    try:
        with sync_playwright() as p:
            browser = _browser(p)
            pages = {}
            for dtype, toggles in clicks.items():
                page = browser.new_context().new_page()
                page.set_viewport_size({"width": 1300, "height": 1200})
                page.goto(dash.url)
                page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
                _choose_model(page, str(tiny_bos))
                for label in toggles:
                    page.get_by_text(label, exact=True).click()
                pages[dtype] = page
            t0 = time.monotonic()
            for page in pages.values():
                page.get_by_role("button", name="Run", exact=True).click()
            done: dict[str, float] = {}
            queued: dict[str, float] = {}
            while len(done) < 3 and time.monotonic() - t0 < 300:
                for dtype, page in pages.items():
                    if dtype in done:
                        continue
                    if dtype not in queued and page.get_by_text("queued: waiting for", exact=False).count():
                        queued[dtype] = time.monotonic() - t0
                    if page.locator(".lpp-tok").count():
                        done[dtype] = time.monotonic() - t0
                page.wait_for_timeout(250)  # a polling interval over three pages, not a wait for a result
            for dtype, page in pages.items():
                settled(page)
                assert page.get_by_text("Could not run").count() == 0 and page.get_by_test_id("stException").count() == 0
                assert page.locator(".lpp-tok").count() > 5, dtype
                page.screenshot(path=str(ARTIFACTS / f"three-users-{dtype}.png"), full_page=True)
            browser.close()
    finally:
        dash.kill()
    print("finished after", done, "queued seen after", queued)
    assert set(done) == {"float16", "bfloat16", "float32"}
    last = max(done, key=done.get)
    assert done[last] > 30 and last in queued and len(queued) >= 2


def test_engines_start_with_the_server_and_serve_the_first_run(home):
    """With prewarm on, the default model's four engines start before any browser connects; the page
    says they are starting; the first Run uses them (no engine is started for it)."""
    from playwright.sync_api import expect, sync_playwright

    # hosts started the ordinary way (no zygote): hosts_of finds them by the parent in their environment
    dash = Dashboard(home, LPP_FAKE_ENGINES="1", LPP_FAKE_LOAD_S="15", LPP_PREWARM="1", LPP_ENGINE_ZYGOTE="")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(hosts_of(dash.proc.pid, spares=False)) < 4:
            time.sleep(0.2)  # polling the process table: no browser has connected yet
        warm = set(hosts_of(dash.proc.pid, spares=False))
        assert len(warm) == 4, "hf and vllm, bfloat16 and float32, started with the server"
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page(viewport={"width": 1300, "height": 1200})
            page.goto(dash.url)
            expect(page.get_by_text("Starting the demo model's 4 engines in the background")).to_be_visible(timeout=30_000)
            page.get_by_role("button", name="Run", exact=True).click()
            page.locator(".lpp-tok").first.wait_for(timeout=120_000)
            settled(page)
            assert page.get_by_test_id("stException").count() == 0
            browser.close()
        # the Run was served by the engines started with the server (spares wait for the next model)
        assert set(hosts_of(dash.proc.pid, spares=False)) == warm
    finally:
        dash.kill()


def test_sigterm_stops_the_dashboard_and_every_engine_host(home, tiny_bos):
    from playwright.sync_api import sync_playwright

    dash = Dashboard(home, LPP_FAKE_ENGINES="1", LPP_ENGINE_ZYGOTE="")  # ordinary hosts: hosts_of finds them
    try:
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page()
            page.goto(dash.url)
            page.get_by_role("button", name="Run", exact=True).wait_for(timeout=60_000)
            _choose_model(page, str(tiny_bos))
            page.get_by_role("button", name="Run", exact=True).click()
            page.locator(".lpp-tok").first.wait_for(timeout=120_000)
            browser.close()
        assert len(hosts_of(dash.proc.pid, spares=False)) == 4  # hf and vllm roles, bfloat16 and float32
        hosts = hosts_of(dash.proc.pid)  # and the spares the ended job left: every one must stop
        os.kill(dash.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            dash.proc.poll() is None or _port_open(dash.port) or any(Path(f"/proc/{h}").exists() for h in hosts)
        ):
            time.sleep(0.2)
        assert dash.proc.poll() is not None, "the dashboard still runs 30 s after SIGTERM"
        assert not _port_open(dash.port), "the port is still answered"
        alive = [
            h for h in hosts if Path(f"/proc/{h}").exists() and "zombie" not in Path(f"/proc/{h}/status").read_text().lower()
        ]
        assert alive == [], "engine hosts outlived the dashboard"
    finally:
        dash.kill()
