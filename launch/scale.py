"""Change the number of rollout actors of a running run: `python launch/scale.py runs/<name> --actors 3`.

The same as `asyncrl scale` (asyncrl/cli/scale.py says what it does).
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
    sys.exit(main(["scale", *sys.argv[1:]]))
