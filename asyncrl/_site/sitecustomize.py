"""Loaded at start-up by every Python process whose PYTHONPATH includes this folder.

asyncrl puts it there (asyncrl/compat.py) only when the parent found torch extras it cannot
import; it marks the packages named in ASYNCRL_HIDE_MODULES absent, so that vLLM's spawned
engine and worker processes and Ray's workers load models as the parent does. Imports nothing.
"""

import os
import sys

for _name in filter(None, os.environ.get("ASYNCRL_HIDE_MODULES", "").split(",")):
    sys.modules.setdefault(_name, None)
