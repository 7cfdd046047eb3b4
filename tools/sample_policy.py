"""Sample a saved policy in vLLM on its run's data: a few completions and the accuracy.

`python tools/sample_policy.py ...` is `asyncrl sample ...`; the options and
examples are in asyncrl/cli/sample.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sample", *sys.argv[1:]]))
