"""The README is a front door: short, opening with the two set-up commands CI runs, every link and
picture resolving, and each picture one that a browser test writes from the real app. (The docs
site's own links are checked by `mkdocs build --strict` in .ci/run.)"""

from __future__ import annotations

import re

from builders import REPO
from test_browser import DOCS_IMG, README_SHOTS

README = (REPO / "README.md").read_text(encoding="utf-8")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_150_lines():
    assert len(README.splitlines()) <= 150


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert README.index("```bash") < README.index("\n## ")  # before anything else
    assert first_block == [
        "bash scripts/setup.sh && .venv/bin/logprob-parity dashboard",
        "bash scripts/setup.sh --test && .venv/bin/python -m pytest",
    ]
    assert first_block[1] in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_relative_link_and_picture_in_the_readme_resolves():
    targets = [t for t in LINK.findall(README) if not re.match(r"[a-z]+://", t)]
    assert len(targets) > 20
    missing = [t for t in targets if not (REPO / t.split("#")[0]).is_file()]
    assert not missing, missing


def test_the_readmes_pictures_are_the_ones_the_browser_tests_write():
    pictures = {t for t in LINK.findall(README) if t.endswith(".png")}
    assert pictures == {f"docs/img/{name}.png" for name in README_SHOTS}, pictures
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").glob("test_*.py"))
    for name in README_SHOTS:
        assert f'docs_shot(page, "{name}")' in sources, name
        assert (DOCS_IMG / f"{name}.png").is_file(), name
