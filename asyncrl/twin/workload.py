"""What the twin's engines generate: response lengths from a distribution and rewards from a
per-prompt pass rate that drifts with the policy version. Both are deterministic functions of the
seed and the sample's identity, so a twin run replays exactly and two modes of one scenario see
the same prompts answered at the same lengths (a fair comparison)."""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Sequence
from pathlib import Path


def _rng(*key: object) -> random.Random:
    return random.Random(zlib.crc32("/".join(map(str, key)).encode()))


class Lengths:
    """Response length of sample i of a prompt, in [1, max_tokens]; at max_tokens it is truncated.

    `group_share` (rho) correlates a prompt's samples: each draw's standard normal is
    sqrt(rho) z_prompt + sqrt(1 - rho) z_sample, so rho is the share of the variance of log length
    (of the normal score, for empirical lengths) that a group has in common, and the marginal
    distribution stays the same."""

    def __init__(self, kind: str, max_tokens: int, seed: int, mean: float = 0.0, sigma: float = 0.0,
                 histogram: Sequence[int] = (), group_share: float = 0.0):
        if kind not in ("fixed", "lognormal", "empirical"):
            raise ValueError(f"lengths.kind must be fixed, lognormal or empirical, got {kind!r}")
        if kind == "empirical" and not histogram:
            raise ValueError("lengths.kind empirical needs the lengths of a real run (lengths.samples)")
        if kind != "empirical" and mean <= 0:
            raise ValueError(f"lengths.mean must be > 0 for {kind} lengths, got {mean}")
        self.kind, self.max_tokens, self.seed = kind, max_tokens, seed
        self.mean, self.sigma, self.histogram = mean, sigma, sorted(histogram)
        if not 0 <= group_share <= 1:
            raise ValueError(f"lengths.group_share must be in [0, 1], got {group_share}")
        self.group_share = group_share

    def _normal(self, prompt_id: str, index: int) -> float:
        z = _rng(self.seed, "len", prompt_id, index).normalvariate(0.0, 1.0)
        if self.group_share:
            shared = _rng(self.seed, "len-prompt", prompt_id.split(".r")[0]).normalvariate(0.0, 1.0)
            z = math.sqrt(self.group_share) * shared + math.sqrt(1 - self.group_share) * z
        return z

    def draw(self, prompt_id: str, index: int) -> int:
        if self.kind == "fixed":
            n = round(self.mean)
        elif self.kind == "lognormal":  # `mean` is the distribution's mean before the cap
            mu = math.log(self.mean) - self.sigma ** 2 / 2
            n = round(math.exp(mu + self._normal(prompt_id, index) * self.sigma))
        elif self.group_share:  # the normal score's quantile of the run's lengths
            q = 0.5 * math.erfc(-self._normal(prompt_id, index) / math.sqrt(2))
            n = self.histogram[min(int(q * len(self.histogram)), len(self.histogram) - 1)]
        else:
            n = _rng(self.seed, "len", prompt_id, index).choice(self.histogram)
        return min(max(n, 1), self.max_tokens)

    def expected(self, draws: int = 20_000) -> float:
        """Mean length after the cap (estimated by drawing)."""
        return sum(self.draw(f"mean{i}", 0) for i in range(draws)) / draws

    def expected_square(self, draws: int = 20_000) -> float:
        return sum(self.draw(f"mean{i}", 0) ** 2 for i in range(draws)) / draws


def lengths_of_run(samples_jsonl: str | Path) -> list[int]:
    """The response lengths (`response_tokens`) of the completions a real run wrote to samples.jsonl."""
    out = []
    for line in Path(samples_jsonl).read_text().splitlines():
        row = json.loads(line)
        n = row.get("response_tokens")
        if n:
            out.append(int(n))
    if not out:
        raise ValueError(f"{samples_jsonl} holds no response lengths (runs before response_tokens was written have none)")
    return out


def group_share_of_run(samples_jsonl: str | Path) -> float:
    """The share of the variance of log response length that samples of one prompt have in common
    (one-way ANOVA's intraclass correlation over the prompts with 2 or more samples in the file),
    the `lengths.group_share` a real run's samples.jsonl implies; 0 when none is positive."""
    groups: dict[str, list[float]] = {}
    for line in Path(samples_jsonl).read_text().splitlines():
        row = json.loads(line)
        if row.get("response_tokens") and row.get("prompt_id") is not None:
            groups.setdefault(f"{row.get('step')}/{row['prompt_id']}", []).append(math.log(row["response_tokens"]))
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    n, k = sum(len(v) for v in groups.values()), len(groups)
    if k < 2 or n <= k:
        raise ValueError(f"{samples_jsonl} has too few prompts with two or more samples to estimate group_share")
    grand = sum(sum(v) for v in groups.values()) / n
    between = sum(len(v) * (sum(v) / len(v) - grand) ** 2 for v in groups.values()) / (k - 1)
    within = sum((x - sum(v) / len(v)) ** 2 for v in groups.values() for x in v) / (n - k)
    n0 = (n - sum(len(v) ** 2 for v in groups.values()) / n) / (k - 1)  # mean group size, unbalanced
    return max(0.0, (between - within) / (between + (n0 - 1) * within)) if between + within > 0 else 0.0


class PassRates:
    """Each prompt's chance of a correct answer: p0 ~ Beta(alpha, beta) per prompt, moved by
    `drift` in log-odds per policy version (learning), so groups of all-correct or all-wrong
    answers happen at the rates they would and dynamic sampling has something to drop."""

    def __init__(self, alpha: float, beta: float, drift_per_version: float, seed: int):
        self.alpha, self.beta, self.drift, self.seed = alpha, beta, drift_per_version, seed
        self._p0: dict[str, float] = {}

    def p(self, prompt_key: str, version: int) -> float:
        if (p0 := self._p0.get(prompt_key)) is None:
            p0 = self._p0[prompt_key] = min(max(_rng(self.seed, "p0", prompt_key).betavariate(self.alpha, self.beta),
                                                1e-6), 1 - 1e-6)
        return 1 / (1 + math.exp(-(math.log(p0 / (1 - p0)) + self.drift * version)))

    def reward(self, prompt_key: str, prompt_id: str, index: int, version: int) -> float:
        return float(_rng(self.seed, "r", prompt_id, index).random() < self.p(prompt_key, version))
