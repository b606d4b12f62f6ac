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
        "bash scripts/setup.sh --test && .venv/bin/python -m pytest -n 2 --dist loadfile",
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


# A command line as the README and the docs show one: in a fenced block or in backticks, after
# `logprob-parity` (or `.venv/bin/logprob-parity`), or in the README's table of commands.
COMMAND = re.compile(r"(?:\.venv/bin/)?logprob-parity ((?:\\\n|[^`\n#])+)")
TABLE_ROW = re.compile(r"^\| `([a-z][a-z-]+(?: [^`]*)?)`", re.M)
PLACEHOLDER_VALUE = re.compile(r"^[A-Z][A-Z_]*$")  # X, N, RUN_ID, FILE: stand for a value a reader types
SUBCOMMANDS = {"compare", "diagnose", "rollout", "rescore", "frontier", "check", "diff", "runs", "show", "report"}
SUBCOMMANDS |= {"dashboard", "demo-model", "--version"}


def _shown_command_lines() -> list[tuple[str, str]]:
    """(where, the command's words) for each command line shown, optional parts ([...]) left out,
    the first of alternatives (a|b) taken, and `...` dropped: what a reader would type first."""
    out = []
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        found = [m.group(1) for m in COMMAND.finditer(text)]
        if page.name == "README.md":
            found += [row.split(" / ")[0].strip("` ") for row in TABLE_ROW.findall(text)]
        for line in found:
            line = line.replace("\\\n", " ")
            while re.search(r"\[[^\[\]]*\]", line):
                line = re.sub(r"\[[^\[\]]*\]", " ", line)
            line = re.sub(r"(\S+?)\|\S+", r"\1", line).replace("...", " ").strip()
            line = line.split("`")[0].strip()
            if line.split(" ")[0] not in SUBCOMMANDS or " --help" in line:
                continue  # prose ("logprob-parity shows ..."), or a help request
            out.append((page.relative_to(REPO).as_posix(), line))
    return out


def test_every_command_line_in_the_readme_and_the_docs_parses_with_the_real_parser():
    """The README once showed `rescore FILE [--map ...]`, which exits with a usage dump; every command
    shown must parse with the parser the tool uses (placeholders such as X stand for a number)."""
    import contextlib
    import io
    import shlex

    from logprob_parity.cli import build_parser

    shown = _shown_command_lines()
    assert len(shown) > 25 and any(w == "README.md" and c.startswith("rescore --rollouts") for w, c in shown)
    bad = []
    for where, line in shown:
        words = shlex.split(line)
        if words == ["--version"]:
            continue
        words = ["1" if PLACEHOLDER_VALUE.match(w) and i and words[i - 1].startswith("--") else w for i, w in enumerate(words)]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(words)
        except SystemExit as exc:
            bad.append(f"{where}: logprob-parity {line!r} -> exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}")
    assert not bad, "\n".join(bad)
