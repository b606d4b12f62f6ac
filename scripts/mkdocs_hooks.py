"""MkDocs hooks: the CLI reference is written from the argparse parser at every build, so the docs
cannot drift from the flags the code takes (a flag added to the settings registry appears here too)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MARK = "<!-- cli-reference -->"


def cli_reference() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ["COLUMNS"] = "110"  # argparse wraps help at the terminal's width: one width for every build
    from logprob_parity.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in sub._choices_actions}
    parts = ["### logprob-parity", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, command in sub.choices.items():
        parts += [f"### {name}", "", helps.get(name) or "", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARK, cli_reference()) if MARK in markdown else markdown
