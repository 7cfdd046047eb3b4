"""`python -m asyncrl <command> ...`: the `asyncrl` command (asyncrl/cli/), as the lab starts runs."""

import sys

from asyncrl.cli import main

sys.exit(main())
