"""Imported by the reward pool's forkserver when the run scores code: finds the sandbox's
isolation once, before any worker is forked, so that every worker inherits it and what is
missing is logged once for the run, not once per worker (see layers.py)."""

from asyncrl.reward.sandbox import isolation

isolation()
