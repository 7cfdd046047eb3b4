"""Verifiers that misbehave on purpose: the test implementations of the reward edge, to check that
a run survives hangs and crashes (they never reach a real run unless a config names them).

    reward.type=import:asyncrl.reward.fault_injection:hang_on_some

- `scripted`: does what the sample's metadata says ("behave": ok / hang / crash / raise, or
  stubborn: hang ignoring SIGTERM, as a verifier stuck in C code does; "sleep_s" first), for
  tests of the pool.
- `hang_on_some` / `crash_on_some`: the math verifier, except that one sample in `EVERY`
  (chosen by a hash of the response, so the same sample always misbehaves) hangs for an hour or
  kills its process. `hang_on_few`: the same hang at one sample in `FEW_EVERY`.
- `crafted_report_on_some`: the math verifier, except that one sample in `CRAFTED_EVERY` is
  scored by the real code verifier on a program whose report is built to make a verifier raise
  (a 400-digit number against a float within a tolerance; a number where the driver writes a
  list). Both must score 0 as failed tests, never count as verifier errors.
- `memory_cycle_on_some`: the math verifier's reward, but every sample also runs a program in the
  code sandbox: one in `CYCLE_EVERY` parks its memory past its end (`MEMORY_CYCLE`), the others
  take 64 MiB and print the right answer (`ORDINARY`), and must score `passed` whatever ran
  before them on their launcher.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

EVERY = 32
FEW_EVERY = 128
CRAFTED_EVERY = 10
_math = None
_code = None
F = "```"
CRAFTED = [  # (program, tests)
    (f"{F}python\ndef f(x):\n    return 10 ** 400\n{F}", [{"type": "call", "fn": "f", "args": [1], "expected": 2.5}]),
    (f"{F}python\nimport os, re, sys\nos.lseek(0, 0, 0)\n"
     f"nonce = re.findall(r\"_asyncrl_main\\('([0-9a-f]+)'\", sys.stdin.read())[0]\n"
     f"sys.stdout.write('\\n' + nonce + '7\\n')\nsys.stdout.flush()\nos._exit(0)\n{F}",
     [{"type": "assert", "code": "assert f(1) == 2"}]),
]

CYCLE_EVERY = 10
MEMORY_CYCLE = """
import array, os, socket
# memory files of 1 MiB each (under any max_file_mb), sent with both ends of their socket over
# that socket: once closed, nothing but the kernel's Unix-socket garbage collector frees them
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
block, fds = b"x" * ((1 << 20) - 4096), []
for _ in range(MIB):
    fds.append(os.memfd_create("parked"))
    os.write(fds[-1], block)
    if len(fds) == 200:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        [os.close(fd) for fd in fds]
        fds = []
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [*fds, a.fileno(), b.fileno()]))])
print("parked")
"""

ORDINARY = 'block = b"x" * (64 << 20)  # an ordinary program\'s memory, written so that it is resident\nprint(3)'


def memory_cycle(mib: int) -> str:
    """The program that parks about `mib` MiB in a descriptor cycle (run it with memory_mb above)."""
    return MEMORY_CYCLE.replace("MIB", str(int(mib)))


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


def _selected(response: str, metadata: dict[str, Any], every: int = EVERY) -> bool:
    return zlib.crc32(f"{metadata.get('record_key')}/{response}".encode("utf-8", "replace")) % every == 0


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


def hang_on_few(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """`hang_on_some` at one sample in `FEW_EVERY`: for a loop fast enough that one in EVERY would
    keep more hangs in flight than a small pool has workers."""
    if _selected(response, metadata, FEW_EVERY):
        time.sleep(3600)
    return _math_reward(response, metadata)


def crash_on_some(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if _selected(response, metadata):
        os._exit(3)
    return _math_reward(response, metadata)


def crafted_report_on_some(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    global _code
    digest = zlib.crc32(f"{metadata.get('record_key')}/{response}".encode("utf-8", "replace"))
    if digest % CRAFTED_EVERY:
        return _math_reward(response, metadata)
    if _code is None:
        from asyncrl.config import CodeRewardConfig
        from asyncrl.reward.code_reward import CodeReward

        _code = CodeReward(CodeRewardConfig(float_tolerance=1e-6))
    program, tests = CRAFTED[digest // CRAFTED_EVERY % len(CRAFTED)]
    reward, info = _code(program, {"tests": tests})
    return reward, {**info, "outcome": f"crafted_{info['outcome']}"}


def memory_cycle_on_some(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    global _code
    if _code is None:
        from asyncrl.config import CodeRewardConfig
        from asyncrl.reward.code_reward import CodeReward

        _code = CodeReward(CodeRewardConfig())
    reward, info = _math_reward(response, metadata)
    attack = zlib.crc32(f"{metadata.get('record_key')}/{response}".encode("utf-8", "replace")) % CYCLE_EVERY == 0
    parked = memory_cycle(_code.cfg.sandbox.memory_mb - 16)
    program = f"{F}python\n{parked if attack else ORDINARY}\n{F}"
    _, sandboxed = _code(program, {"tests": [{"type": "stdio", "input": "", "output": "3"}]})
    return reward, {**info, "outcome": f"{'cycle' if attack else 'honest'}_{sandboxed['outcome']}"}


def solves_even_records(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Reward 1 for every sample of a record with an even index: those prompts are "solved"
    (pass rate 1), for tests of online filtering."""
    index = int(str(metadata.get("record_key", "x/1")).rsplit("/", 1)[1])
    return float(index % 2 == 0), {"outcome": "scripted"}


def by_response_hash(response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Reward 1 for about half the responses, decided by a hash of the text: deterministic, and
    mixed within a group, so runs that must be compared bit for bit have non-zero advantages."""
    return float(zlib.crc32(response.encode("utf-8", "replace")) % 2), {"outcome": "scripted"}
