"""The best generation/training split and staleness bound for a GPU count, found in the digital twin.

`python tools/plan_cluster.py SCENARIO ...` is `asyncrl plan-cluster SCENARIO ...`; the options and
examples are in asyncrl/cli/plan_cluster.py.
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
    sys.exit(main(["plan-cluster", *sys.argv[1:]]))
