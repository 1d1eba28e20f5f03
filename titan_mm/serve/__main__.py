"""``python -m titan_mm.serve``: the server's command line (titan_mm/serve/entrypoints/cli.py)."""

import sys

from titan_mm.serve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
