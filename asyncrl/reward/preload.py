"""Imported once by the reward pool's forkserver, before it forks any worker: imports the verifiers
and runs the math verifier on a few answers of the common kinds, so that the lazy imports and
parse caches of math-verify and sympy are warm in every worker the pool ever starts.

Why: a cold first verification costs 0.1 to 1 s (more on a busy machine), so a fresh worker, the
one that replaces a timed-out one, would spend its first call's timeout warming up; under a short
timeout that cascades into timeouts of ordinary samples.
"""

from asyncrl.reward import code_reward, registry, text_rewards  # noqa: F401  (imported to be forked)
from asyncrl.reward.math_reward import MathReward

WARM_UP = [  # (response, gold): fraction vs decimal, polynomial, set, interval, tuple, text
    (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{x^2+1}", "1+x^2"), (r"\boxed{\{1,2\}}", r"\{2,1\}"),
    (r"\boxed{(0,1]}", "(0, 1]"), (r"\boxed{(1,2)}", "(1, 2)"), (r"\boxed{\sqrt{2}\pi}", r"\pi\sqrt{2}"),
    (r"\boxed{3 \text{ cm}}", "3"), (r"\boxed{2.5\%}", "0.025"),
    # letters in a number, what a policy early in training writes: symbols times numbers against
    # a number cost ~0.2 s cold, enough to time out a worker on a busy machine
    (r"\boxed{a7}", "15"), (r"\boxed{2c/4}", "3"), (r"\boxed{2P5}", "7"), (r"\boxed{e{z}}", "2"),
]


def warm_up() -> None:
    verifier = MathReward()
    for response, gold in WARM_UP:
        verifier(response, {"answer": gold})


warm_up()
