"""`python -m dilated_attn`: the `dilated-attn` command (dilated_attn.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
