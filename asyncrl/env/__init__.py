"""Environments for multi-turn and tool-using episodes (asyncrl/env/base.py is the protocol)."""
