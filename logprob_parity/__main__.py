"""`python -m logprob_parity`: the console script, for a checkout or an environment without it on PATH."""

import sys

from logprob_parity.cli import main

if __name__ == "__main__":
    sys.exit(main())
