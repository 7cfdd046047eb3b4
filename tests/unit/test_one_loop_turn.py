"""One definition of the loop turn: `Driver.turn` (orchestrator/driver.py) decides the cadence of
ingest, rewards, admission and cuts; the orchestrator, the twin and the orchestrator bench feed it
and carry out its actions. Checked on the source: nobody else reads the bookkeeping period, calls
the steps a turn is made of, or reaches through the driver to its parts."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "asyncrl" / "orchestrator" / "driver.py"
# the driver's parts: reached only through its methods
PARTS = {"ledger", "stats", "evaluator", "intake", "rewards", "stages", "route", "gate"}
# what one turn is made of: called by the driver's turn, not by its callers
TURN_STEPS = {"admit", "next_batch", "ingest", "capacity"}


def sources() -> list[Path]:
    return sorted([*(ROOT / "asyncrl").rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "launch").glob("*.py")])


def is_driver(node: ast.AST, aliases: set[str]) -> bool:
    """`driver`, `x.driver`, or a local name bound to either."""
    if isinstance(node, ast.Attribute):
        return node.attr == "driver"
    return isinstance(node, ast.Name) and (node.id == "driver" or node.id in aliases)


def driver_aliases(tree: ast.AST) -> set[str]:
    aliases = set()
    for n in ast.walk(tree):  # d = self.driver
        if isinstance(n, ast.Assign) and is_driver(n.value, set()):
            aliases |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple):  # d, x = self.driver, ...
            for t in n.targets:
                if isinstance(t, ast.Tuple):
                    aliases |= {e.id for e, v in zip(t.elts, n.value.elts)
                                if isinstance(e, ast.Name) and is_driver(v, set())}
    return aliases


def reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module reads the cadence, calls a turn's step on a driver, or reaches its parts."""
    aliases, found = driver_aliases(tree), []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id == "BOOKKEEPING_S":
            found.append((n.lineno, "BOOKKEEPING_S"))
        if isinstance(n, ast.alias) and n.name == "BOOKKEEPING_S":
            found.append((0, "imports BOOKKEEPING_S"))
        if isinstance(n, ast.Attribute) and is_driver(n.value, aliases) and n.attr in PARTS | TURN_STEPS:
            found.append((n.lineno, ast.unparse(n)))
        if isinstance(n, ast.Attribute) and n.attr == "buffer" and isinstance(n.value, ast.Attribute) \
                and n.value.attr == "ledger":
            found.append((n.lineno, ast.unparse(n)))
    return found


def test_the_checker_sees_each_way_around_the_turn():
    src = """
from asyncrl.orchestrator.driver import BOOKKEEPING_S
d = self.driver
d.ledger.admit(p)
self.driver.next_batch(0)
driver.stats.flush()
x = self.thing.ledger.buffer.num_loss_tokens
d.turn(now, [], self)
"""
    found = [what for _, what in reaches(ast.parse(src))]
    assert found.count("imports BOOKKEEPING_S") == 1
    assert {"d.ledger", "self.driver.next_batch", "driver.stats", "self.thing.ledger.buffer"} <= set(found)
    assert not any("turn" in f for f in found)


def test_only_the_driver_decides_the_loop_turn():
    found = []
    for path in sources():
        if path == DRIVER:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in reaches(ast.parse(path.read_text()))]
    assert not found, found


def test_the_orchestrator_the_twin_and_the_bench_each_turn_the_driver():
    for path in (ROOT / "asyncrl/orchestrator/orchestrator.py", ROOT / "asyncrl/twin/cluster.py",
                 ROOT / "tools/bench_orchestrator.py"):
        tree = ast.parse(path.read_text())
        aliases = driver_aliases(tree)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "turn" and is_driver(n.func.value, aliases)]
        assert len(calls) == 1, path
