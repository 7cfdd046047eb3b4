"""Evaluate policies on held-out data: avg@n and pass@k, overall and per data_source.

`python tools/evaluate.py ...` is `asyncrl evaluate ...`; the options and
examples are in asyncrl/cli/evaluate.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
