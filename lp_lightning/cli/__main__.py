"""``python -m lp_lightning.cli ...``: the console entry point :func:`lp_lightning.cli.main`."""

import sys

from lp_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
