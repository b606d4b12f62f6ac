"""A parity check as a CI reads it: JUnit XML (one test case a bound) and a Markdown summary to post."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any


def junit_xml(result: Any) -> str:
    """One <testcase> a bound, a <failure> with its line when it fails (ElementTree escapes every text)."""
    suite = ET.Element(
        "testsuite",
        name="logprob-parity check",
        tests=str(len(result.outcomes)),
        failures=str(sum(not o.passed for o in result.outcomes)),
        errors="0",
    )
    for o in result.outcomes:
        case = ET.SubElement(suite, "testcase", classname=f"logprob-parity.{o.dtype}.{o.run_id[:12]}", name=o.words[5:])
        if not o.passed:
            ET.SubElement(case, "failure", message=o.words).text = o.words
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"


def markdown(result: Any) -> str:
    """A table a CI can post on a pull request: each bound, its value, its limit, pass or fail."""
    head = "**logprob-parity: parity holds**" if result.passed else "**logprob-parity: parity check failed**"
    lines = [head, "", "| | dtype | run | measured | bound | what |", "|---|---|---|---|---|---|"]
    for o in result.outcomes:
        what = o.words.split(": ", 1)[1] if ": " in o.words else o.words
        lines.append(
            f"| {'✅' if o.passed else '❌'} | {o.dtype} | `{o.run_id[:12]}` | {_n(o.key, o.value)} | {_n(o.key, o.limit)} | "
            f"{what.replace('|', chr(92) + '|')} |"  # a table cell keeps |Δ logp| as written: the bar escaped
        )
    lines += [f"- {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def _n(key: str, v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.2%}" if key == "argmax_agreement" else f"{v:.3e}"
