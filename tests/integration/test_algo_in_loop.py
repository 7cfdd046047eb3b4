"""The algorithm's mechanisms acting in the real loop (Ray, a vLLM-CPU actor, the torch learner):
adaptive entropy control pushing entropy toward a target above the policy's, reference resets
(scheduled and requested while the run goes on) zeroing KL and restarting the optimizer, and
every switch's metrics in the step rows. One run is shared (engine start-up dominates)."""

import json
import threading
import time

import pytest
import ray

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator

STEPS = 8
TARGET = 5.0   # nats: far above the tiny policy's entropy, so e_k < target at every step
DELTA = 0.04
RESET_EVERY = 5


def request_reset_when(run_dir, min_rows):
    """Create RESET_REFERENCE once the run has logged `min_rows` steps, as an operator would."""
    metrics = run_dir / "metrics.jsonl"
    while True:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= min_rows:
            (run_dir / "RESET_REFERENCE").touch()
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, [
        f"model.path={tiny_model_path}", "buffer.token_budget=128", "buffer.max_staleness=1",
        f"total_steps={STEPS}", "learner.lr=1.5e-3", "algo.drop_zero_variance_groups=false", "observe.console=off",
        "observe.tensorboard=false", "eval.every_steps=0",
        f"observe.output_dir={out}", "name=algo", "save_final=false",
        "algo.entropy_control.enabled=true", f"algo.entropy_control.target={TARGET}",
        f"algo.entropy_control.delta={DELTA}", "algo.entropy_control.coef_max=null",  # c rises k * DELTA
        "algo.kl.coef=1e-3", f"algo.kl.reset_every={RESET_EVERY}",
        "algo.decoupled=true", "algo.is_weight_cap=2.0", "algo.dual_clip=3.0",
    ])
    # zero-variance groups are kept: an entropy bonus this strong can make every reward 0, and
    # dropping those groups would stall the run; what is tested here is the mechanisms
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    orch = Orchestrator(cfg)
    operator = threading.Thread(target=request_reset_when, args=(cfg.run_dir.resolve(), 2), daemon=True)
    operator.start()
    try:
        orch.run()
        events = [json.loads(x) for x in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
        yield orch.history, events
    finally:
        orch.shutdown()
        ray.shutdown()


def test_alpha_rises_from_zero_and_entropy_moves_toward_the_target(run):
    rows, _ = run
    alphas = [r["entropy/coef"] for r in rows]
    assert all(r["entropy_control/measured"] < TARGET for r in rows)
    assert alphas == pytest.approx([DELTA * k for k in range(STEPS)])  # alpha_k = c_k = k * delta
    entropy = [r["entropy/learner"] for r in rows]
    assert sum(entropy[-3:]) / 3 > entropy[0] * 1.05, entropy


def test_reference_resets_zero_kl_and_restart_the_optimizer(run):
    rows, events = run
    resets = [e for e in events if e["event"] == "reference_reset"]
    reasons = sorted(e["reason"] for e in resets)
    assert reasons == ["every_k", "requested"], resets
    assert rows[0]["kl/mean"] == 0.0
    for e in resets:
        step = e["step"]
        assert rows[step - 1]["kl/reset"] == 1.0
        if step < STEPS:
            after = rows[step]  # the first step after the reset
            assert after["kl/mean"] == 0.0 and after["learner/optimizer_steps"] == 1
    assert any(r["kl/mean"] > 1e-6 for r in rows), "KL never moved: the test would not notice a broken reset"
    assert rows[-1]["kl/resets_total"] == 2


def test_every_switch_is_logged(run):
    rows, _ = run
    for key in ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "ratio/mean", "ratio/max",
                "entropy/learner", "entropy/behaviour_sampled", "entropy_control/alpha", "kl/mean",
                "is_weight/mean", "is_weight/max", "is_weight/capped_frac", "rollout/truncated_frac",
                "buffer/groups_zero_variance_total", "kl/reset", "stage/index"):
        assert all(key in r for r in rows), key
    assert all(r["ratio/mean"] == pytest.approx(1.0, abs=1e-6) for r in rows)  # decoupled: rho = 1 in value
    assert all(0.0 < r["is_weight/mean"] <= 2.0 and r["is_weight/max"] <= 2.0 for r in rows)
