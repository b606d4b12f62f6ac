"""The dashboard server: `logprob-parity dashboard` execs this module, which starts the default
engines warming (core.analysis.prewarm) and then runs Streamlit in this same process, so the
engines are in the pool the pages use and SIGTERM still reaches Streamlit directly.

    python -m dashboard.serve [streamlit run options...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> None:
    from core.analysis import prewarm
    from streamlit.web import cli

    prewarm.start()
    sys.argv = ["streamlit", "run", str(ROOT / "dashboard" / "app.py"), *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
