"""Reward throughput on this machine, each figure beside its raw baseline measured in the same run:

- math verifications/s: the math verifier called in-process (the baseline), then through the
  reward pool with --workers processes (ratio pool / direct);
- pool overhead per sample: a verifier that returns at once, through the pool with one worker,
  minus the same call made directly (what a sample pays for the process boundary and timeout);
- sandbox runs/s: one Python program run by the sandbox, against the same program run by a bare
  subprocess.run, in --rounds alternating rounds (each side's rate per round, the ratio of the
  medians), and code-verifier samples/s (3 stdio tests each). The sandbox's setup (which layers,
  which back end) is printed first.

    python tools/bench_rewards.py [--seconds 5] [--workers 2] [--rounds 5] [--backend auto]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

# (response, gold): string matches, equivalent forms math-verify has to parse, wrong answers
MATH_CASES = [
    (r"So the answer is \boxed{42}.", "42"),
    (r"<think>2+2</think> \boxed{4}", "4"),
    (r"Thus \boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}"),
    (r"\boxed{(0, 1]}", "(0,1]"),
    (r"\boxed{50\%}", "0.5"),
    (r"\boxed{3.14}", r"\pi"),
    (r"\boxed{7}", "8"),
    (r"no box here, 12", "12"),
]
SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = [{"type": "stdio", "input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in ((1, 2), (5, 7), (10, -3))]


def rate(fn, seconds: float) -> tuple[float, int]:
    """Calls per second of fn() over about `seconds` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0), n


def pool_rate(pool, cases, n: int) -> float:
    """Samples per second through the pool, keeping every worker busy."""
    for i, (response, metadata) in zip(range(n), itertools.cycle(cases)):
        pool.submit(i, response, metadata)
    done, t0 = 0, time.perf_counter()
    while done < n:
        done += len(pool.poll(1.0))
    return n / (time.perf_counter() - t0)


def bench_math(seconds: float, workers: int) -> dict[str, float]:
    from asyncrl.config import RewardConfig
    from asyncrl.reward.math_reward import MathReward
    from asyncrl.reward.pool import RewardPool
    from asyncrl.reward.registry import RewardRouter

    verifier, cases = MathReward(), [(r, {"answer": g}) for r, g in MATH_CASES]
    cycle = itertools.cycle(cases)
    direct, n = rate(lambda: verifier(*next(cycle)), seconds)
    pool = RewardPool(functools.partial(RewardRouter, RewardConfig()), workers, timeout_s=30)
    try:
        pool.wait_ready()
        pooled = pool_rate(pool, cases, max(n, 50))
    finally:
        pool.close()
    return {"direct": direct, "pool": pooled}


def bench_overhead(seconds: float) -> dict[str, float]:
    from asyncrl.config import RewardConfig
    from asyncrl.reward.fault_injection import scripted
    from asyncrl.reward.pool import RewardPool
    from asyncrl.reward.registry import RewardRouter

    cfg = RewardConfig(type="import:asyncrl.reward.fault_injection:scripted")
    direct_per_s, n = rate(lambda: scripted("x", {"reward": 1.0}), seconds / 2)
    pool = RewardPool(functools.partial(RewardRouter, cfg), 1, timeout_s=30)
    try:
        pool.wait_ready()
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 2:  # one at a time: latency, not throughput
            pool.submit(k, "x", {"reward": 1.0})
            while not pool.poll(1.0):
                pass
            k += 1
        pooled_s = (time.perf_counter() - t0) / k
    finally:
        pool.close()
    return {"direct_s": 1 / direct_per_s, "pool_s": pooled_s, "overhead_s": pooled_s - 1 / direct_per_s}


def bench_sandbox(seconds: float, rounds: int, backend: str) -> dict:
    from asyncrl.config import CodeRewardConfig, SandboxConfig
    from asyncrl.reward.code_reward import PYTHON, CodeReward
    from asyncrl.reward.sandbox import isolation, release, run_sandboxed

    limits = SandboxConfig(backend=backend)
    print(isolation(backend).describe())
    program = "print(sum(map(int, input().split())))"
    argv = [PYTHON, "-I", "-S", "-B", "-c", program]
    bare, sandboxed = [], []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as d:
        workdir = Path(d)
        assert run_sandboxed(argv, b"1 2\n", limits, workdir).stdout == b"3\n", "the sandbox must run it"
        for _ in range(rounds):  # alternating, so that the machine's noise hits both sides
            bare.append(rate(lambda: subprocess.run(argv, input=b"1 2\n", capture_output=True, check=True),
                             seconds / 2)[0])
            sandboxed.append(rate(lambda: run_sandboxed(argv, b"1 2\n", limits, workdir), seconds / 2)[0])
    verifier = CodeReward(CodeRewardConfig(sandbox=limits))
    assert verifier(SOLUTION, {"tests": TESTS})[0] == 1.0, "the benchmark's solution must pass"
    samples, _ = rate(lambda: verifier(SOLUTION, {"tests": TESTS}), seconds)
    release()
    return {"bare": bare, "sandboxed": sandboxed, "code_samples": samples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    p.add_argument("--workers", type=int, default=2, help="reward pool workers for the math figure")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of bare and sandboxed runs")
    p.add_argument("--backend", default="auto", choices=["auto", "namespaces", "bwrap"], help="sandbox back end")
    args = p.parse_args()

    m = bench_math(args.seconds, args.workers)
    o = bench_overhead(args.seconds)
    s = bench_sandbox(args.seconds, args.rounds, args.backend)
    print(f"{'measurement':<44}{'baseline':>14}{'asyncrl':>14}{'ratio':>8}")
    print(f"{'math verifications/s (direct | pool x' + str(args.workers) + ')':<44}"
          f"{m['direct']:>14.1f}{m['pool']:>14.1f}{m['pool'] / m['direct']:>8.2f}")
    print(f"{'per-sample latency ms (direct | pool x1)':<44}"
          f"{o['direct_s'] * 1e3:>14.4f}{o['pool_s'] * 1e3:>14.3f}{'':>8}")
    print(f"{'  pool overhead per sample (ms)':<44}{'':>14}{o['overhead_s'] * 1e3:>14.3f}")
    bare, sandboxed = statistics.median(s["bare"]), statistics.median(s["sandboxed"])
    print(f"{'python runs/s (bare subprocess | sandbox)':<44}{bare:>14.1f}{sandboxed:>14.1f}{sandboxed / bare:>8.2f}")
    for i, (b, x) in enumerate(zip(s["bare"], s["sandboxed"])):
        print(f"{f'  round {i + 1}':<44}{b:>14.1f}{x:>14.1f}{x / b:>8.2f}")
    print(f"{'code verifier samples/s (3 stdio tests each)':<44}{'':>14}{s['code_samples']:>14.1f}")


if __name__ == "__main__":
    main()
