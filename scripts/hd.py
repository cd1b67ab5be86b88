#!/usr/bin/env python3
"""vllm-hopper-decode tooling: `python3 scripts/hd.py --help` lists the commands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hdtool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
