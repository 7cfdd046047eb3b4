"""Figures and a report (no verdicts) from any run directories.

`python tools/plot_runs.py ...` is `asyncrl plot ...`; the options and
examples are in asyncrl/cli/plot.py.
"""

import os
import sys
from pathlib import Path

# This checkout's asyncrl, in this process and in every one it starts (Ray's workers, reward
# workers, vLLM's engine), whatever else is installed.
CHECKOUT = str(Path(__file__).resolve().parents[1])
sys.path[1:1] = [CHECKOUT]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["plot", *sys.argv[1:]]))
