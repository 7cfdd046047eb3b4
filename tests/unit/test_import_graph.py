"""The package's import graph has no circles: a protocol never imports its implementations (the
factory lives in the package's face), and a receiver never imports its sender (what both share is
in its own module). Every import counts, a function's lazy one and an `if TYPE_CHECKING:` one
too: a type named across a circle is a dependency as real as a call (give the callee a small
protocol of what it uses, as rollout/episode.py's `Completer`, instead).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"

# One circle inside one component, between files of the same role: the sandbox's isolation probe
# (layers.py) runs `true` through the runner, which applies the layers it found.
SAME_ROLE = [{"asyncrl.reward.sandbox.layers", "asyncrl.reward.sandbox.runner"}]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules a file imports (`from pkg import submodule` names the submodule)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or ({node.module} & modules)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(ast.parse(p.read_text()), set(files)) - {name} for name, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle_through_a_lazy_or_type_hint_import():
    graph = {"a.protocol": {"a.impl"}, "a.impl": {"a.protocol"}, "a": {"a.impl"}, "b": set()}
    assert circles(graph) == [{"a.protocol", "a.impl"}]
    code = "def make():\n    from a.impl import Impl\nif TYPE_CHECKING:\n    from a.other import X\n"
    assert imports(ast.parse(code), {"a.impl", "a.other"}) == {"a.impl", "a.other"}


def test_no_import_circle_in_the_package():
    found = [c for c in circles(import_graph()) if c not in SAME_ROLE]
    assert not found, found


def test_the_factories_live_in_the_package_faces():
    graph = import_graph()
    assert not graph["asyncrl.sync.protocol"] & {"asyncrl.sync.gloo_sender", "asyncrl.sync.nccl_sender"}
    assert not graph["asyncrl.learner.backend"] & {"asyncrl.learner.torch_backend", "asyncrl.learner.deepspeed_backend"}
    receivers = ("asyncrl.sync.gloo_receiver", "asyncrl.sync.vllm_receiver", "asyncrl.sync.vllm_gloo_engine")
    assert not any(graph[r] & {"asyncrl.sync.gloo_sender", "asyncrl.sync.nccl_sender"} for r in receivers)


def instance_attributes(path: Path, cls: str) -> set[str]:
    """The names a class's methods assign on `self` (`self.x = ...`, `self.x, self.y = ...`)."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == cls)
    names = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def test_the_learner_rank_is_a_process_shell():
    """The step's work and the algorithm's state are PolicyStep's (learner/step.py): the rank keeps
    what a process holds (sockets, the backend, the version, the sender) and stays small."""
    attrs = instance_attributes(PACKAGE / "learner" / "rank.py", "LearnerRank")
    assert len(attrs) <= 15, sorted(attrs)
    assert "step" in attrs and not attrs & {"algo", "reference", "proximal", "entropy"}


def test_the_twin_keeps_its_learner_and_its_driver_apart():
    """The simulated learner (its step, its push, the cores it shares) is its own object
    (twin/learner.py); the twin wires it to the engines, the actors and the driver's turn."""
    attrs = instance_attributes(PACKAGE / "twin" / "cluster.py", "Twin")
    assert len(attrs) <= 25, sorted(attrs)
    assert "learner" in attrs and not any("push" in a or "work" in a for a in attrs)


def test_the_orchestrator_keeps_the_loop_and_the_steps_finish():
    """Start, take-over, a learner's replacement and shutdown are lifecycle.py's; the run's times
    are clock.py's: the orchestrator stays a loop a reader takes in at once."""
    source = PACKAGE / "orchestrator" / "orchestrator.py"
    assert len(source.read_text().splitlines()) <= 300
    attrs = instance_attributes(source, "Orchestrator")
    assert not attrs & {"_t_start", "_elapsed_before", "_overlap_tokens", "_loop_s", "_start_point", "model_path"}
    calls = {n.func.attr for n in ast.walk(ast.parse(source.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    # what lifecycle.py does for it: building the driver, the socket, the ranks and the group
    assert not calls & {"form_weight_sync_group", "replace_learner", "rebind", "load_checkpoint"}, calls


# records a component keeps its own counts in: writing their fields is the owner's bookkeeping
OWN_RECORDS = {"stats", "counts", "log"}  # log: CallStitcher's CallLog


def test_no_component_writes_another_components_fields():
    """`self.b.c = ...` (b another component) changes a collaborator behind its back: the ledger,
    the weight sync, the actor pool and the intake each offer a method for what their owner needs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for e in target.elts if isinstance(target, ast.Tuple) else [target]:
                    inner = e.value if isinstance(e, ast.Attribute) else None
                    if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                            and inner.value.id == "self" and inner.attr not in OWN_RECORDS):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{e.lineno}: {ast.unparse(e)}")
    assert not found, found


def metadata_episode_reads(tree: ast.AST) -> list[ast.AST]:
    """`<...metadata...>["episode"]` and `<...metadata...>.get("episode")`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            owner, key = node.value, node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args):
            owner, key = node.func.value, node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and key.value == "episode" and "metadata" in ast.unparse(owner):
            found.append(node)
    return found


def test_the_episode_record_travels_typed():
    """An episode's record is `Sample.episode` (types.EpisodeRecord), carried by the codec; only the
    verifiers' view (reward/episode_reward.py) holds it as `metadata["episode"]`, for user verifiers."""
    assert len(metadata_episode_reads(ast.parse("s.metadata.get('episode'); key.metadata['episode']['spans']"))) == 2
    view = PACKAGE / "reward" / "episode_reward.py"
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != view
             for node in metadata_episode_reads(ast.parse(path.read_text()))]
    assert not found, found
