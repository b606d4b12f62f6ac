"""The dashboard server: `logprob-parity dashboard` execs this module, which starts the default
engines warming (logprob_parity.analysis.prewarm) and then runs Streamlit in this same process, so the
engines are in the pool the pages use and SIGTERM still reaches Streamlit directly.

    python -m logprob_parity.dashboard.serve [streamlit run options...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the package: a checkout runs uninstalled
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> None:
    from streamlit.web import cli

    from logprob_parity.analysis import prewarm
    from logprob_parity.engines.pool import POOL

    POOL.keep_spares = True  # a model switch on a page loads into a host that has done its imports
    prewarm.start()
    sys.argv = ["streamlit", "run", str(Path(__file__).resolve().parent / "app.py"), *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
