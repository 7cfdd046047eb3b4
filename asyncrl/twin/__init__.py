"""A digital twin of a GPU cluster for asyncrl's loop: engines, learner and network as cost
models on a virtual clock, the real driver deciding (cluster.py). It measures what the one CPU
machine cannot: the asynchronous advantage, the split of GPUs, the staleness and the driver's
own load at a cluster's scale (`asyncrl twin`, `asyncrl plan-cluster`, docs/design/twin.md).

    scenario.py  the YAML a scenario is (configs/twin/)
    costs.py     engine step, learner step, push: pure cost models
    workload.py  response lengths and rewards, deterministic per sample
    engine.py    continuous batching in closed form between events
    actor.py     a rollout actor's requests, gate, drain and in-flight updates
    rewards.py   the driver's verifier pool on the virtual clock
    capacity.py  the ideal rates of a split, the share of groups dynamic sampling keeps
    cluster.py   the event loop around the real driver; its results
    bench.py     a scenario's modes side by side: table, figure, summary JSON (asyncrl twin)
    plan.py      the best split and staleness bound for a GPU count (asyncrl plan-cluster)
    calibrate.py fitting a scenario to a measured machine (tools/validate_twin.py)
"""
