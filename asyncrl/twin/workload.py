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
    """Response length of sample i of a prompt, in [1, max_tokens]; at max_tokens it is truncated."""

    def __init__(self, kind: str, max_tokens: int, seed: int, mean: float = 0.0, sigma: float = 0.0,
                 histogram: Sequence[int] = ()):
        if kind not in ("fixed", "lognormal", "empirical"):
            raise ValueError(f"lengths.kind must be fixed, lognormal or empirical, got {kind!r}")
        if kind == "empirical" and not histogram:
            raise ValueError("lengths.kind empirical needs the lengths of a real run (lengths.samples)")
        if kind != "empirical" and mean <= 0:
            raise ValueError(f"lengths.mean must be > 0 for {kind} lengths, got {mean}")
        self.kind, self.max_tokens, self.seed = kind, max_tokens, seed
        self.mean, self.sigma, self.histogram = mean, sigma, sorted(histogram)

    def draw(self, prompt_id: str, index: int) -> int:
        if self.kind == "fixed":
            n = round(self.mean)
        elif self.kind == "lognormal":  # `mean` is the distribution's mean before the cap
            mu = math.log(self.mean) - self.sigma ** 2 / 2
            n = round(_rng(self.seed, "len", prompt_id, index).lognormvariate(mu, self.sigma))
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
