"""The planner: for a scenario's model, workload and GPU count, which split of the GPUs between
generation and training, and which staleness bound, trains the most tokens a second.

Splits are ranked first in closed form (capacity.py: each side's rate with nothing waiting, the
share of groups dynamic sampling keeps from the pass-rate model); the best few are then run in the
twin, in-flight mode, for every eta asked, since how close a split comes to its ideal depends on
the staleness bound and the length tail, which only the loop itself shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.twin.capacity import gen_tokens_per_s, keep_fraction, train_tokens_per_s
from asyncrl.twin.cluster import Twin
from asyncrl.twin.scenario import Scenario, Split


def with_split(sc: Scenario, gen_gpus: int, train_gpus: int, eta: int | None = None) -> Scenario:
    run = sc.run if eta is None else sc.run.model_copy(update={"max_staleness": eta})
    return sc.model_copy(update={"split": Split(gen_gpus=gen_gpus, train_gpus=train_gpus, tp=sc.split.tp), "run": run})


def ideal_tokens_per_s(sc: Scenario) -> tuple[float, float, float]:
    """(ideal, generation side's trainable tokens/s, training side's tokens/s) of sc's split."""
    lengths, w = sc.lengths(), sc.workload
    mean, mean_sq = lengths.expected(), lengths.expected_square()
    keep = keep_fraction(w.pass_rate.alpha, w.pass_rate.beta, w.group_size)
    gen = keep * gen_tokens_per_s(sc.engine_cost(), sc.split.engines, sc.engine.max_num_seqs, sc.kv_tokens(),
                                  w.prompt_tokens, mean, mean_sq)
    train = train_tokens_per_s(sc.learner_cost(), sc.push_cost(), sc.run.token_budget, w.prompt_tokens, mean)
    return min(gen, train), gen, train


def candidate_splits(sc: Scenario, gpus: int, keep: int = 3) -> list[tuple[int, int, float]]:
    """The `keep` splits of `gpus` with the highest ideal rate: (gen_gpus, train_gpus, ideal)."""
    tp, out = sc.split.tp, []
    for gen in range(tp, gpus, tp):
        out.append((gen, gpus - gen, ideal_tokens_per_s(with_split(sc, gen, gpus - gen))[0]))
    return sorted(out, key=lambda c: -c[2])[:keep]


@dataclass
class Trial:
    gen_gpus: int
    train_gpus: int
    eta: int
    ideal: float
    result: dict[str, Any]

    @property
    def rate(self) -> float:
        return self.result["trained_tokens_per_s"]


def plan(sc: Scenario, gpus: int, etas: list[int], splits: int = 3, max_staleness_mean: float | None = None,
         tie: float = 0.02, say=print) -> tuple[Trial | None, list[Trial]]:
    """Every (split, eta) tried, and the best: of the plans whose mean staleness is within
    `max_staleness_mean` (None: any), the least stale of those within `tie` of the highest
    trained tokens/s (staleness that buys nothing is not worth its off-policy cost)."""
    trials = []
    for gen, train, ideal in candidate_splits(sc, gpus, splits):
        for eta in etas:
            r = Twin(with_split(sc, gen, train, eta), "inflight").run()
            trials.append(Trial(gen, train, eta, ideal, r))
            say(f"  {gen} gen + {train} train GPUs, eta {eta}: {r['trained_tokens_per_s']:,.0f} trained tokens/s "
                f"({r['fraction_of_ideal']:.2f} of ideal), staleness {r['staleness_mean']:.2f}")
    ok = [t for t in trials if max_staleness_mean is None or t.result["staleness_mean"] <= max_staleness_mean]
    if not ok:
        return None, trials
    top = max(t.rate for t in ok)
    return min((t for t in ok if t.rate >= (1 - tie) * top), key=lambda t: t.result["staleness_mean"]), trials


def run_overrides(sc: Scenario, t: Trial) -> list[str]:
    """The asyncrl run config of a trial's split (one engine per tp GPUs, a learner rank a GPU)."""
    tp = sc.split.tp
    return [f"rollout.num_actors={t.gen_gpus // tp}", f"rollout.num_gpus_per_actor={tp}",
            f"rollout.tensor_parallel_size={tp}", f"learner.num_ranks={t.train_gpus}", "learner.num_gpus=1",
            "sync.type=nccl", "sync.mode=inflight", f"buffer.max_staleness={t.eta}",
            f"buffer.token_budget={sc.run.token_budget}", f"rollout.group_size={sc.workload.group_size}",
            f"rollout.max_tokens={sc.workload.max_tokens}"]
