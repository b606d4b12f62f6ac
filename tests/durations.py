"""Each test module's seconds in a whole run, which orders the modules on two processes: the longest
first, so none of them starts last while the other process has nothing left (pytest-split keeps such
a file for the same reason). Only the order depends on it; a module missing from it runs after the
measured ones. Written from a run's JUnit XML:

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/run.xml
    .venv/bin/python tests/durations.py /tmp/run.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")


def module_seconds() -> dict[str, float]:
    """Module name ("test_cli") -> its seconds in the run the file was written from."""
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def main(junit_xml: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        seconds[case.get("classname", "").split(".")[-1]] += float(case.get("time", 0))
    FILE.write_text(json.dumps({m: round(s, 1) for m, s in sorted(seconds.items())}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
