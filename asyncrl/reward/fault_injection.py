"""Verifiers that misbehave on purpose: the test implementations of the reward edge, to check that
a run survives hangs and crashes (they never reach a real run unless a config names them).

    reward.type=import:asyncrl.reward.fault_injection:hang_on_some

- `scripted`: does what the sample's metadata says ("behave": ok / hang / crash / raise, or
  stubborn: hang ignoring SIGTERM, as a verifier stuck in C code does; "sleep_s" first), for
  tests of the pool.
- `hang_on_some` / `crash_on_some`: the math verifier, except that one sample in `EVERY`
  (chosen by a hash of the response, so the same sample always misbehaves) hangs for an hour or
  kills its process.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

EVERY = 32
_math = None


def scripted(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    behave = metadata.get("behave", "ok")
    time.sleep(float(metadata.get("sleep_s", 0.0)))  # a slow but well-behaved verifier
    if behave == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behave in ("hang", "stubborn"):
        time.sleep(3600)
    elif behave == "crash":
        os._exit(3)
    elif behave == "raise":
        raise RuntimeError("verifier bug")
    return float(metadata.get("reward", 1.0)), {"outcome": "scripted"}


def _selected(response: str, metadata: dict[str, Any]) -> bool:
    return zlib.crc32(f"{metadata.get('record_key')}/{response}".encode("utf-8", "replace")) % EVERY == 0


def _math_reward(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    global _math
    if _math is None:
        from asyncrl.reward.math_reward import MathReward

        _math = MathReward()
    return _math(response, metadata)


def hang_on_some(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if _selected(response, metadata):
        time.sleep(3600)
    return _math_reward(response, metadata)


def crash_on_some(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if _selected(response, metadata):
        os._exit(3)
    return _math_reward(response, metadata)


def solves_even_records(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Reward 1 for every sample of a record with an even index: those prompts are "solved"
    (pass rate 1), for tests of online filtering."""
    index = int(str(metadata.get("record_key", "x/1")).rsplit("/", 1)[1])
    return float(index % 2 == 0), {"outcome": "scripted"}


def by_response_hash(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Reward 1 for about half the responses, decided by a hash of the text: deterministic, and
    mixed within a group, so runs that must be compared bit for bit have non-zero advantages."""
    return float(zlib.crc32(response.encode("utf-8", "replace")) % 2), {"outcome": "scripted"}
