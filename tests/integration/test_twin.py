"""The twin (asyncrl/twin/) running the real driver: throughput against hand-computed rates for
constant lengths and constant costs, and a run replayed exactly for a seed."""

import json

import pytest

from asyncrl.twin.cluster import Twin
from asyncrl.twin.scenario import Scenario

L, PROMPT, G = 100, 20, 4  # response and prompt tokens, group size


def scenario(mode_overrides: dict, **run) -> Scenario:
    """Two engines whose every step takes 10 ms whatever they hold (64 requests at most), constant
    responses of L tokens, verifiers that take no time, every group kept (zero-variance groups are
    not dropped)."""
    tree = {
        "name": "hand", "seed": 3,
        "model": {"params": 1.0, "kv_bytes_per_token": 1.0, "bytes_per_param": 1.0},
        "split": {"gen_gpus": 2, "train_gpus": 1},
        "engine": {"c0_s": 0.01, "c_seq_s": 0.0, "c_ctx_s": 0.0, "c_prefill_s": 0.0, "kv_tokens": 1_000_000,
                   "max_num_seqs": 64},
        "learner": {"mfu": 1.0, "fixed_s": 0.5, "per_token_s": 1e-4},
        "push": {"fixed_s": 0.2, "load_bytes_per_s": 1e30},
        "hardware": {"peak_flops": 1e30, "intra_node": {"alpha_s": 1e-12, "beta_bytes_per_s": 1e30}},
        "workload": {"prompt_tokens": PROMPT, "max_tokens": 2 * L, "group_size": G,
                     "lengths": {"kind": "fixed", "mean": L}, "pass_rate": {"alpha": 1, "beta": 1}, "verify_s": 0.0},
        "run": {"token_budget": 3200, "max_staleness": 8, "steps": 14, "warmup_steps": 4, "sync_prompts": 8,
                "overrides": ["algo.drop_zero_variance_groups=false"], **run},
    }
    for dotted, value in mode_overrides.items():
        section, key = dotted.split(".")
        tree[section][key] = value
    return Scenario.model_validate(tree)


def test_sync_step_is_one_batch_generated_then_trained_then_pushed():
    r = Twin(scenario({}), "sync", charge_driver=False).run()
    # colocated on all 3 GPUs: 8 prompts x 4 = 32 responses (3200 tokens) at once, 100 steps of 10 ms; the
    # step trains 32 x (20 + 100) tokens: 0.5 + 3840e-4 s; the push 0.2 s
    period = L * 0.01 + 0.5 + 32 * (PROMPT + L) * 1e-4 + 0.2
    assert r["steps_per_s"] == pytest.approx(1 / period, rel=0.01)
    assert r["all_trained_tokens_per_s"] == pytest.approx(3200 / period, rel=0.01)
    # only groups with mixed rewards carry a gradient
    assert r["trained_tokens_per_s"] == pytest.approx(3200 / period * r["keep_frac"], rel=0.05)
    assert 0.3 < r["keep_frac"] < 0.9
    assert r["staleness_max"] == 0 and r["stale_dropped_frac"] == 0


def test_a_delta_push_costs_its_changed_elements_and_a_whole_push_every_full_every_versions():
    """Weights of 2e9 bytes (1e9 bf16 parameters) over a 1e9 B/s link: a whole push is 2 s of
    transfer; a delta of 1% of the elements is 1e9 x 0.01 x (4 + 2) = 6e7 bytes, 0.06 s, after the
    learner's search through all 2e9 bytes at 4e9 B/s, 0.5 s. The synchronous step is the one above
    plus that."""
    heavy = {"model.params": 1e9, "model.bytes_per_param": 2.0,
             "hardware.intra_node": {"alpha_s": 1e-12, "beta_bytes_per_s": 1e9}}
    base = L * 0.01 + 0.5 + 32 * (PROMPT + L) * 1e-4 + 0.2
    periods = {}
    delta = {"push.transfer": "delta", "push.changed_frac": 0.01, "push.encode_bytes_per_s": 4e9}
    for name, push in [("full", {}), ("delta", delta), ("every 2", {**delta, "push.full_every": 2})]:
        periods[name] = 1 / Twin(scenario({**heavy, **push}), "sync", charge_driver=False).run()["steps_per_s"]
    assert periods["full"] == pytest.approx(base + 2.0, rel=0.01)
    assert periods["delta"] == pytest.approx(base + 0.5 + 0.06, rel=0.01)
    # the 10 measured steps (versions 5-14) push whole at the even ones, with no search
    assert periods["every 2"] == pytest.approx(base + (2.0 + 0.5 + 0.06) / 2, rel=0.01)


def test_the_decoupled_baseline_trains_on_the_split_and_the_colocated_one_on_every_gpu():
    """A learner whose compute scales with its GPUs (6 FLOPs x 1 param x 3840 tokens at 38,400
    FLOP/s: 0.6 s on one GPU, 0.2 s on three) beside 0.5 s fixed, a push of 0.2 s, generation
    1 s (100 steps of 10 ms on the engines, two or three, every request at once): colocated a step
    is 1 + 0.5 + 0.2 + 0.2 = 1.9 s; decoupled, on the split's one training GPU, 1 + 0.5 + 0.6 + 0.2."""
    per_gpu = {"learner.per_token_s": 0.0, "hardware.peak_flops": 38_400.0}
    colocated = Twin(scenario(per_gpu), "sync", charge_driver=False).run()
    decoupled = Twin(scenario(per_gpu), "sync_decoupled", charge_driver=False).run()
    assert colocated["engines"] == 3 and decoupled["engines"] == 2
    assert colocated["steps_per_s"] == pytest.approx(1 / 1.9, rel=0.01)
    assert decoupled["steps_per_s"] == pytest.approx(1 / 2.3, rel=0.01)


def test_colocate_async_shares_every_gpu_at_a_staleness_of_one():
    """With no contention (colocate_slowdown 1) the colocated asynchronous layout is the in-flight
    loop at eta 1 with every GPU on both sides; sharing the GPUs slows it."""
    fast = {"learner.fixed_s": 0.05, "learner.per_token_s": 0.0, "push.fixed_s": 0.0}
    shared = Twin(scenario(fast), "colocate_async", charge_driver=False).run()
    alone = Twin(scenario(fast, colocate_slowdown=1.0), "colocate_async", charge_driver=False).run()
    split = Twin(scenario({**fast, "split.gen_gpus": 3, "split.train_gpus": 3}, max_staleness=1), "inflight",
                 charge_driver=False).run()
    assert shared["engines"] == alone["engines"] == 3
    assert alone["trained_tokens_per_s"] == split["trained_tokens_per_s"]
    assert alone["staleness_max"] == split["staleness_max"] <= 2  # eta 1, plus a split rest
    assert shared["trained_tokens_per_s"] < 0.97 * alone["trained_tokens_per_s"]


def test_keep_kv_resumes_nothing_and_prefills_nothing_again():
    """In-flight updates with a prefill cost: aborting re-prefills each request's prompt and prefix
    (reprefill_frac > 0); with keep_kv the requests pause in place and nothing is prefilled again."""
    prefill = {"engine.c_prefill_s": 1e-4, "learner.fixed_s": 0.3}
    aborted = Twin(scenario(prefill, overrides=[]), "inflight", charge_driver=False).run()
    kept = Twin(scenario(prefill, keep_kv=True, overrides=[]), "inflight", charge_driver=False).run()
    assert aborted["resumed_requests"] > 0 and aborted["reprefill_frac"] > 0.001
    assert kept["resumed_requests"] == 0 and kept["reprefill_frac"] == 0.0
    assert kept["trained_tokens_per_s"] > aborted["trained_tokens_per_s"]


def test_async_is_the_min_of_generation_and_training_rates():
    # generation-bound: 2 engines x 64 tokens per 10 ms = 12,800 tokens/s, against a learner that
    # would take 3200 tokens in 0.05 s + a free push
    # (every response ends in the same step, so steps come 4 at a time: whole waves are measured)
    fast_learner = {"learner.fixed_s": 0.05, "learner.per_token_s": 0.0, "push.fixed_s": 0.0}
    r = Twin(scenario(fast_learner, steps=16, warmup_steps=4), "inflight", charge_driver=False).run()
    assert r["all_trained_tokens_per_s"] == pytest.approx(12_800, rel=0.03)
    assert r["gen_util"] > 0.97
    # occupancy: 64 requests running of max_num_seqs 64 whenever the engines are busy
    assert r["gen_occupancy"] == pytest.approx(r["gen_util"], rel=0.02)
    # training-bound: a step of 1 s and a push of 0.2 s a step, 3200 tokens each
    slow_learner = {"learner.fixed_s": 1.0, "learner.per_token_s": 0.0}
    r = Twin(scenario(slow_learner), "inflight", charge_driver=False).run()
    assert r["all_trained_tokens_per_s"] == pytest.approx(3200 / 1.2, rel=0.01)
    assert r["train_util"] == pytest.approx(1.0 / 1.2, rel=0.01)
    assert r["fraction_of_ideal"] == pytest.approx(1.0, rel=0.03)


def test_a_learner_sharing_cores_with_the_engines_runs_slower_while_they_compute():
    """0.5 s of work (an empty batch: learner.fixed_s), twice as slow while an engine computes:
    alone 0-0.1 s (0.1 done), beside an engine 0.1-0.5 s (0.2 done), alone again: it ends at 0.7 s."""
    from types import SimpleNamespace

    from asyncrl.twin.engine import Request

    twin = Twin(scenario({"learner.slowdown_while_generating": 2.0}), "inflight", charge_driver=False)
    try:
        twin._start_step(SimpleNamespace(chunks=[]), 0.0)
        engine = twin.engines[0]  # c0 10 ms a step: 40 steps from 0.1 s
        engine.on_finished = lambda requests, t: None  # a request of no actor's
        twin.events.at(0.1, lambda t: engine.submit([Request(context=PROMPT, remaining=40)], t))
        while twin.learner.state == "training":
            assert twin.events.run_next()
        assert twin.events.now == pytest.approx(0.7)
        assert twin.learner.busy.by_bin and sum(twin.learner.busy.by_bin.values()) == pytest.approx(0.7)
    finally:
        twin.close()


def test_a_twin_run_replays_exactly_for_a_seed():
    sc = scenario({"workload.lengths": {"kind": "lognormal", "mean": 60, "sigma": 0.8},
                   "workload.pass_rate": {"alpha": 1, "beta": 2, "drift_per_version": 0.1}},
                  overrides=[], steps=8, warmup_steps=2)
    runs = [Twin(sc, "inflight", charge_driver=False).run() for _ in range(2)]
    for r in runs:
        r.pop("driver_core_frac")  # the driver's measured CPU time: not part of the simulation
    assert json.dumps(runs[0], sort_keys=True) == json.dumps(runs[1], sort_keys=True)
    assert runs[0]["resumed_requests"] > 0 and 0 < runs[0]["keep_frac"] < 1  # in-flight updates, dropped groups


def test_default_admission_keeps_the_length_bias_within_two_percent():
    # a long tail (lognormal, sigma 1, capped at 8x the mean) on a fast learner that keeps eta 1
    # binding: with the default admission (AReaL's bound on what is admitted, stale tokens
    # dropped), the trained responses' mean length stays within 2% of the generated ones'
    sc = scenario({"workload.lengths": {"kind": "lognormal", "mean": 60, "sigma": 1.0},
                   "workload.max_tokens": 480, "learner.fixed_s": 0.2, "learner.per_token_s": 0.0},
                  max_staleness=1, steps=30, warmup_steps=5, overrides=[])
    r = Twin(sc, "inflight", charge_driver=False).run()
    assert r["stale_dropped_frac"] > 0  # the bound bites: some work goes stale
    assert abs(r["length_bias"]) < 0.02


def test_asyncrl_twin_prints_the_summary_json_and_draws_the_figure(tmp_path, capsys):
    import yaml

    from asyncrl.cli.twin import main

    path = tmp_path / "hand.yaml"
    path.write_text(yaml.safe_dump(scenario({}, steps=8, warmup_steps=2).model_dump(exclude_none=True)))
    assert main([str(path), "learner.fixed_s=1.0", "--modes", "sync", "sync_decoupled", "inflight", "--no-charge",
                 "--out", str(tmp_path / "out")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("trained_tokens_per_s", "sync_trained_tokens_per_s", "async_over_sync", "async_over_decoupled",
                "ideal_tokens_per_s", "fraction_of_ideal", "gen_util", "gen_occupancy", "reprefill_frac", "train_util",
                "staleness_mean", "staleness_max", "length_bias", "driver_core_frac"):
        assert isinstance(last[key], float), key
    assert last["async_over_sync"] == pytest.approx(last["trained_tokens_per_s"] / last["sync_trained_tokens_per_s"])
    assert last["async_over_decoupled"] == pytest.approx(
        last["trained_tokens_per_s"] / last["sync_decoupled_trained_tokens_per_s"])
    assert (tmp_path / "out" / "utilisation.png").stat().st_size > 10_000
    # a field the scenario does not have: one line naming it, exit 2
    assert main([str(path), "run.max_stalenes=2"]) == 2
    assert "run.max_stalenes" in capsys.readouterr().out
