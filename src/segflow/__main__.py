"""``python -m segflow``: the same command line as the ``segflow`` script."""

import sys

from segflow.cli import main

sys.exit(main(sys.argv[1:]))
