"""`python -m fastweights ...`: the `fastweights` console script (fastweights.cli:main)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
