"""``python -m polyrl ...``: the same as the ``polyrl`` command."""

import sys

from polyrl.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
