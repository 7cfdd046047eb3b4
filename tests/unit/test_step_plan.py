"""What a learner step runs besides its loss (`plan_step`), per batch role and algorithm config:
each extra pass is there exactly when something reads its result."""

import pytest

from asyncrl.config import AlgoConfig
from asyncrl.learner.entropy_schedule import EntropySchedule
from asyncrl.learner.step import plan_step
from asyncrl.types import Batch, ResponseSpan


def batch(role, opened=True):
    layout = [ResponseSpan("g0", 0, 0, 4)] if role == "open" and opened else []
    return Batch(step=1, rank=0, chunks=[], num_loss_tokens_global=4, num_sequences_global=1, token_budget=4,
                 role=role, opened_layout=layout)


def plan(role, moe=False, opened=True, **algo):
    cfg = AlgoConfig(**algo)
    return plan_step(batch(role, opened), cfg, EntropySchedule(cfg), moe)


@pytest.mark.parametrize("role", ["own", "open", "continue"])
def test_a_plain_step_runs_its_loss_alone(role):
    p = plan(role)
    assert not (p.open_pass or p.exact_entropy or p.routing or p.sampled_entropy or p.m2po)
    assert p.proximal == (role != "own")  # a reused batch's ratio is against pi_prox


@pytest.mark.parametrize("algo", [{"decoupled": True}, {"entropy_control": {"enabled": True, "measure": "exact"}}])
def test_opening_a_rollout_batch_passes_over_it_once_when_pi_prox_or_its_entropy_is_read(algo):
    assert plan("open", **algo).open_pass
    assert not plan("continue", **algo).open_pass and not plan("own", **algo).open_pass
    assert not plan("open", opened=False, **algo).open_pass  # no layout: no batch opened


@pytest.mark.parametrize("measure,role,exact,sampled", [
    ("exact", "own", True, False), ("exact", "open", False, False), ("exact", "continue", False, False),
    ("sampled_nll", "own", False, True), ("sampled_nll", "open", False, True),
    ("sampled_nll", "continue", False, False),
    ("lagged", "own", False, False), ("lagged", "open", False, False),
])
def test_entropy_control_measures_only_where_its_e_k_is_read(measure, role, exact, sampled):
    p = plan(role, entropy_control={"enabled": True, "measure": measure})
    assert (p.exact_entropy, p.sampled_entropy) == (exact, sampled)


def test_routing_pass_only_for_a_moe_model_whose_load_balance_loss_trains():
    assert plan("own", moe=True, moe_aux_loss_coef=0.01).routing
    assert not plan("own", moe=True, moe_aux_loss_coef=0.0).routing
    assert not plan("own", moe=False, moe_aux_loss_coef=0.01).routing


def test_m2po_gathers_its_threshold():
    assert plan("own", policy_loss="m2po").m2po and not plan("own").m2po
