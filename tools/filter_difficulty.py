"""Offline difficulty filter: drop the prompts the initial policy always or never solves.

`python tools/filter_difficulty.py ...` is `asyncrl filter-difficulty ...`; the options and
examples are in asyncrl/cli/filter_difficulty.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["filter-difficulty", *sys.argv[1:]]))
