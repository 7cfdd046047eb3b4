"""Change the number of rollout actors of a running run: `python launch/scale.py runs/<name> --actors 3`.

The same as `asyncrl scale` (asyncrl/cli/scale.py says what it does).
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["scale", *sys.argv[1:]]))
