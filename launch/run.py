"""Entry point: `python launch/run.py [--config configs/<recipe>.yaml] [--print-config] [section.field=value ...]`.

The same as `asyncrl run` (asyncrl/launch.py says what a run does, its signals and exit codes);
this file stays so that `ray job submit --working-dir . -- python launch/run.py ...` has a script.
"""

import os
import sys
from pathlib import Path

# This checkout's asyncrl, in this process and in every one it starts (Ray's workers, reward
# workers, vLLM's engine), whatever else is installed; and, as `python launch/run.py` always
# did, a user's reward modules from the working directory (a `ray job submit --working-dir`).
CHECKOUT = str(Path(__file__).resolve().parents[1])
sys.path[1:1] = [CHECKOUT, os.getcwd()]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
