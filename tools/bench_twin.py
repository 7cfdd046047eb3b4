"""A GPU cluster scenario in the digital twin: sync, drain and in-flight modes of the real driver.

`python tools/bench_twin.py SCENARIO ...` is `asyncrl twin SCENARIO ...`; the options and
examples are in asyncrl/cli/twin.py.
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
    sys.exit(main(["twin", *sys.argv[1:]]))
