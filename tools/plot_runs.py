"""Figures and a report (no verdicts) from any run directories.

`python tools/plot_runs.py ...` is `asyncrl plot ...`; the options and
examples are in asyncrl/cli/plot.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["plot", *sys.argv[1:]]))
