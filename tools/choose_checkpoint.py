"""Choose the SFT checkpoint to start RL from by its token entropy on the RL prompts.

`python tools/choose_checkpoint.py ...` is `asyncrl choose-checkpoint ...`; the options and
examples are in asyncrl/cli/choose_checkpoint.py.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["choose-checkpoint", *sys.argv[1:]]))
