"""`python -m asyncrl.cli <command> ...`: the `asyncrl` command."""

import sys

from asyncrl.cli import main

sys.exit(main())
