import os

import pytest

# vLLM-CPU must not claim most of the machine for its KV cache in any test.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from asyncrl.compat import hide_broken_torch_extras  # noqa: E402

hide_broken_torch_extras()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The default tiny model (built once, then reused from the cache like the demo does)."""
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model

    return str(ensure_tiny_model(TinyModelSpec()))


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A barely warm-started tiny model for fake-engine runs (built once per session, in its own
    cache directory, so it never touches the user's)."""
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(warm_start_steps=10, num_eval_prompts=8)
    return str(ensure_tiny_model(spec, cache_dir=tmp_path_factory.mktemp("cache"), log=lambda _: None))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for a module's runs, one after another, as runs submitted to a cluster
    share it (each run's shutdown hands its actors' and learner's CPUs back); a cluster per run
    cost 5-7 s more each on 2 cores (start, stop, and the run's first workers on a cold cluster)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need CUDA: without it they are deselected (reported as such), never
    counted as passed or skipped-as-passed."""
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def _cpu_jiffies() -> tuple[int, int] | None:
    """(all, idle) CPU time of the whole machine since boot, in clock ticks; None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks), ticks[3] + ticks[4]  # idle and iowait: no core had work


_IDLE: list[tuple[str, float, float]] = []  # (test, idle core-seconds, core-seconds the machine had)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """How much of the whole machine's CPU sat idle during each test (setup, call, teardown). Idle
    cores mean waiting (a timeout, a sleep) or one process at a time (a vLLM engine's serial start):
    time that can be cut without cutting work. tools/suite_times.py sums it by file."""
    before = _cpu_jiffies()
    yield
    after = _cpu_jiffies()
    if before and after:
        tick = os.sysconf("SC_CLK_TCK")
        _IDLE.append((item.nodeid, (after[1] - before[1]) / tick, (after[0] - before[0]) / tick))


def pytest_terminal_summary(terminalreporter):
    waits = sorted((t for t in _IDLE if t[2] >= 2.0), key=lambda t: -t[1])
    if waits:
        terminalreporter.section("machine idle per test (core-seconds; 2.0 or more available)")
        for nodeid, idle, had in waits:
            terminalreporter.write_line(idle_line(nodeid, idle, had))


def idle_line(nodeid: str, idle: float, had: float) -> str:
    """One test's line of the summary, as tools/suite_times.py reads it."""
    return f"idle {idle:.1f} of {had:.1f} core-s  {nodeid}"
