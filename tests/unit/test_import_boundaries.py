"""Heavy imports stay in adapter files: the core imports with vllm, ray and deepspeed blocked."""

import subprocess
import sys
from pathlib import Path

CORE = [
    "asyncrl.config", "asyncrl.types", "asyncrl.algo.advantages", "asyncrl.algo.policy_loss",
    "asyncrl.algo.token_stats", "asyncrl.buffer.token_buffer", "asyncrl.buffer.group_assembler",
    "asyncrl.buffer.packing", "asyncrl.transport.codec", "asyncrl.transport.zmq_stream",
    "asyncrl.data.prompt_source", "asyncrl.rollout.actor", "asyncrl.rollout.engine",
    "asyncrl.rollout.fake_engine", "asyncrl.learner.collate", "asyncrl.learner.policy_step",
    "asyncrl.learner.rank", "asyncrl.learner.backend", "asyncrl.learner.torch_backend", "asyncrl.learner.collectives",
    "asyncrl.orchestrator.admission", "asyncrl.orchestrator.driver", "asyncrl.sync.buckets",
    "asyncrl.sync.gloo_sender", "asyncrl.sync.protocol", "asyncrl.observe.metrics",
    "asyncrl.reward.math_reward", "asyncrl.tiny.task",
]


def import_with_blocked(modules: list[str], blocked: tuple[str, ...]) -> None:
    """Import `modules` in a fresh interpreter in which importing any of `blocked` fails."""
    code = (
        "import sys\n"
        f"for m in {blocked!r}: sys.modules[m] = None\n"
        f"for m in {modules!r}: __import__(m)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_core_modules_import_without_vllm_ray_or_deepspeed():
    import_with_blocked(CORE, ("vllm", "ray", "deepspeed"))


def test_algo_is_pure_math():
    code = (
        "import sys\n"
        "import asyncrl.algo.advantages, asyncrl.algo.policy_loss, asyncrl.algo.token_stats\n"
        "bad = [m for m in ('vllm', 'ray', 'zmq', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_analysis_reads_runs_without_matplotlib_torch_or_ray():
    """Only asyncrl/analysis/plots.py imports matplotlib; reading runs and judging them, and planning
    and running a study, need neither torch nor Ray (the runs do, in their own processes)."""
    import_with_blocked(["asyncrl.analysis.curves", "asyncrl.analysis.runs", "asyncrl.analysis.verdict",
                         "asyncrl.analysis.arms", "asyncrl.analysis.report", "asyncrl.config.study",
                         "asyncrl.study.plan", "asyncrl.study.runner", "asyncrl.offline.run_policies",
                         "asyncrl.offline.difficulty", "asyncrl.offline.entropy_band"],
                        ("matplotlib", "torch", "vllm", "ray", "deepspeed"))
    imports = subprocess.run(["grep", "-rlE", "^(import|from) matplotlib", "asyncrl"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    assert imports.stdout.split() == ["asyncrl/analysis/plots.py"]
