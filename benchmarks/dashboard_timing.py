"""Time from pressing Run to a rendered token view, and to reopen the stored run from its share link.

Runs `streamlit run` with a fresh store (sharing the built demo model) and drives Debian's Chromium.
    python benchmarks/dashboard_timing.py [--model demo] [--dtypes float32,bfloat16]
Prints a markdown table and writes it to benchmarks/results/dashboard_timing.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from core.paths import store_root  # noqa: E402

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shot", default=None, help="save a screenshot of the compare page here")
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="lpp-bench-"))
    models = store_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(models)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LOGPROB_PARITY_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/_stcore/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=ARGS)
            page = b.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(url)
            page.get_by_role("button", name="Run").wait_for(timeout=60_000)
            want = set(a.dtypes.split(","))
            for d in ("float16", "bfloat16", "float32"):
                box = page.get_by_role("checkbox", name=d, exact=True)
                if box.is_checked() != (d in want):
                    page.get_by_text(d, exact=True).click()
            for label in ("first Run (engines start)", "repeat Run, new text (warm engines)"):
                if "repeat" in label:
                    page.get_by_role("textbox", name="Text").fill("The committee will meet on Thursday to review the budget.")
                before = page.evaluate("window.location.search")
                t = time.perf_counter()
                page.get_by_role("button", name="Run").click()
                # the view is rendered once the URL names the new runs and their rows are drawn
                page.wait_for_function("old => window.location.search.includes('runs=') && window.location.search !== old",
                                       arg=before, timeout=900_000)
                page.locator(".lpp-row").nth(len(want) - 1).wait_for(timeout=60_000)
                rows.append((label, time.perf_counter() - t))
            if a.shot:
                page.get_by_role("textbox", name="Text").fill(
                    "Dave lives in Palm Coast, FL and is a lawyer. His personal interests include playing guitar, hiking, "
                    "and spending time with his family.")
                before = page.evaluate("window.location.search")
                page.get_by_role("button", name="Run").click()
                page.wait_for_function("old => window.location.search !== old", arg=before, timeout=900_000)
                page.wait_for_timeout(3000)
                page.screenshot(path=a.shot, full_page=True)
            share = page.get_by_role("textbox", name="Share this view").first.input_value()
            other = b.new_context().new_page()
            t = time.perf_counter()
            other.goto(share)
            other.locator(".lpp-row").nth(len(want) - 1).wait_for(timeout=60_000)
            rows.append(("reopen stored run from its share link (new browser context)", time.perf_counter() - t))
            b.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)
    table = ["| step | seconds |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in rows]
    head = f"Dashboard timing, demo model (SmolLM2-135M), dtypes {a.dtypes}, seed sentence, {platform.processor() or platform.machine()}, {os.cpu_count()} cores\n\n"
    out = REPO / "benchmarks" / "results" / "dashboard_timing.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(head + "\n".join(table) + "\n")
    print(head + "\n".join(table))


if __name__ == "__main__":
    main()
