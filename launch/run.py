"""Entry point: `python launch/run.py [--config configs/<recipe>.yaml] [--print-config] [section.field=value ...]`.

The same as `asyncrl run` (asyncrl/launch.py says what a run does, its signals and exit codes);
this file stays so that `ray job submit --working-dir . -- python launch/run.py ...` has a script.
"""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncrl, installed or not
from asyncrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
