"""Heavy imports stay in adapter files: the core imports with vllm, ray and deepspeed blocked. The
lab (asyncrl/lab/) imports the pipeline and is never imported by it."""

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"
ENTRY_POINTS = ("asyncrl.__main__", "asyncrl.cli")  # the `asyncrl` command: the one place above both

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
    """Only asyncrl/lab/analysis/plots.py imports matplotlib; reading runs and judging them, and planning
    and running a study, need neither torch nor Ray (the runs do, in their own processes)."""
    import_with_blocked(["asyncrl.lab.analysis.curves", "asyncrl.lab.analysis.runs", "asyncrl.lab.analysis.verdict",
                         "asyncrl.lab.analysis.arms", "asyncrl.lab.analysis.report", "asyncrl.lab.analysis.marks",
                         "asyncrl.lab.analysis.outliers", "asyncrl.lab.analysis.config_diff", "asyncrl.lab.study.config",
                         "asyncrl.lab.study.plan", "asyncrl.lab.study.runner", "asyncrl.lab.study.conduct",
                         "asyncrl.lab.offline.run_policies", "asyncrl.lab.offline.difficulty",
                         "asyncrl.lab.offline.entropy_band", "asyncrl.cli"],
                        ("matplotlib", "torch", "vllm", "ray", "deepspeed"))
    imports = subprocess.run(["grep", "-rlE", "^(import|from) matplotlib", "asyncrl"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    assert imports.stdout.split() == ["asyncrl/lab/analysis/plots.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every module an import statement in the file names (also inside functions), and every
    string constant that looks like a dotted asyncrl name (importlib, `import:` reward specs)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("asyncrl."):
            out.add(node.value.split(":")[0])
    return out


def import_graph() -> dict[str, set[str]]:
    """asyncrl module -> the asyncrl modules importing it runs (each named module and its parent
    packages, whose __init__ runs first)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if "recipes" not in p.relative_to(PACKAGE).parts}
    graph = {}
    for name, path in files.items():
        edges = set()
        for imported in imported_names(path):
            parts = imported.split(".")
            edges.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in files)
        graph[name] = edges - {name}
    return graph


def is_lab(module: str) -> bool:
    return module == "asyncrl.lab" or module.startswith("asyncrl.lab.")


def test_the_pipeline_never_imports_the_lab():
    """No module outside asyncrl/lab reaches asyncrl.lab through any chain of imports, the entry
    points of the `asyncrl` command (cli/, __main__) aside: they dispatch to both."""
    graph = import_graph()
    assert any(is_lab(m) for m in graph) and "asyncrl.orchestrator.orchestrator" in graph  # the walk sees both
    pipeline = [m for m in graph if not is_lab(m) and not m.startswith(ENTRY_POINTS)]
    leaks = []
    for start in pipeline:
        came_from = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            if is_lab(module):
                chain = [module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                leaks.append(" -> ".join(reversed(chain)))
                break
            for nxt in sorted(graph[module] - came_from.keys()):
                came_from[nxt] = module
                queue.append(nxt)
    assert not leaks, "the pipeline imports the lab:\n" + "\n".join(leaks)



def test_rollout_and_learner_know_nothing_of_the_demo_model():
    """The built-in tiny model is the demo's: an engine, an actor or a learner rank is given where
    the model is on its node (types.Locate, made by the orchestrator), never the tiny package."""
    graph = import_graph()
    wings = [m for m in graph if m.startswith(("asyncrl.rollout", "asyncrl.learner"))]
    assert "asyncrl.rollout.vllm_engine" in wings and "asyncrl.learner.rank" in wings  # the walk sees them
    reach = {m: sorted(t for t in graph[m] if t == "asyncrl.tiny" or t.startswith("asyncrl.tiny.")) for m in wings}
    assert not {m: t for m, t in reach.items() if t}, reach
