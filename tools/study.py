"""Run a study: a grid of arms x seeds on a base recipe, then its figures, report and verdicts.

`python tools/study.py ...` is `asyncrl study ...`; the options and
examples are in asyncrl/cli/study.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["study", *sys.argv[1:]]))
