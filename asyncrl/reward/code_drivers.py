"""What runs beside a solution in the sandbox for call and assert tests, and what stays outside.

The solution runs in the same interpreter as the test driver, so anything in the driver is the
solution's to read (its source on stdin, its frames, its memory). Expected values are therefore
never sent in:
- call tests: the driver calls `fn(*args, **kwargs)` and reports the value; the verifier compares.
- assert tests: the test code is rewritten here first (`rewrite_asserts`). An assert with a
  constant side, `assert <expr> <op> <constant>` (either order; op one of == != < <= > >= in
  `not in` is `is not`; the constant a literal, or set()/tuple()/sorted()/float()... of one) and
  `assert math.isclose(<expr>, <constant>, ...)` / `assert abs(<expr> - <constant>) < <constant>`
  become probes, `_asyncrl_probe(i, <expr>)`, which report the value of <expr>; the comparison is
  made outside (`check`) with the constant the sandbox never saw. Every probe must report at
  least once, so a solution that forges the driver's report needs the very values it cannot see.
  Other asserts (`assert is_prime(7)`, `assert f(x) == g(x)`) stay as they are: their expectation
  is "true", nothing to hide, and a solution forging the report passes them (as before).
  A probe does not stop the test where a failing assert did: a later error counts as a crash.

Values cross as tagged JSON (tuples, sets, bytes, complex, non-finite floats and dict keys of any
type kept; any other object becomes an opaque value equal to nothing) and are compared with
Python's own operators, so `assert f() == (1, 2)` means outside what it meant inside.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import time
from typing import Any

PROBE = "_asyncrl_probe"
MAX_DEPTH = 100
_SAFE_CALLS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict,
               "sorted": sorted, "float": float, "int": int, "str": str, "complex": complex,
               "bool": bool, "bytes": bytes}
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_MIRROR = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<=", "is": "is",
           "is not": "is not", "in": "contains", "not in": "not contains"}
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
            ">": operator.gt, ">=": operator.ge, "is": operator.is_, "is not": operator.is_not,
            "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
            "contains": lambda a, b: b in a, "not contains": lambda a, b: b not in a}

# The encoder, as it runs in the sandbox (it is also exec'd here, so both sides agree).
ENCODER = '''
def _asyncrl_encode(v, depth=0):
    if depth > 100:
        return {"$": "opaque"}
    if v is None or isinstance(v, (bool, str)) or type(v) is int:
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else {"$": "float", "v": repr(v)}
    if isinstance(v, complex):
        return {"$": "complex", "v": [_asyncrl_encode(v.real), _asyncrl_encode(v.imag)]}
    if isinstance(v, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes(v).decode("latin-1")}
    kinds = ((list, "list"), (tuple, "tuple"), (frozenset, "frozenset"), (set, "set"))
    for kind, name in kinds:
        if isinstance(v, kind):
            return {"$": name, "v": [_asyncrl_encode(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"$": "dict", "v": [[_asyncrl_encode(k, depth + 1), _asyncrl_encode(x, depth + 1)]
                                   for k, x in v.items()]}
    return {"$": "opaque"}
'''

_DRIVER = ENCODER + """
import json, os, sys
sys.path.insert(0, os.getcwd())
def _asyncrl_main(nonce, kind, spec):
    probes = []
    def probe(i, value):
        probes.append([i, _asyncrl_encode(value)])  # encoded now: later mutation does not count
    if kind == "call":
        import solution
        fn = getattr(solution, spec["fn"], None)
        if fn is None and hasattr(solution, "Solution"):
            fn = getattr(solution.Solution(), spec["fn"])
        probe(0, fn(*spec["args"], **spec["kwargs"]))
    else:
        namespace = {"__name__": "solution"}  # no `if __name__ == "__main__"` block of the solution
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
        namespace["__name__"] = "__main__"  # ...but the test script's own main block runs
        namespace["PROBE"] = probe
        try:
            exec(compile(spec["code"], "test.py", "exec"), namespace)
        except AssertionError:
            sys.stdout.write("\\n" + nonce + "fail\\n")
            return
    sys.stdout.write("\\n" + nonce + json.dumps(probes) + "\\n")
""".replace("PROBE", PROBE)


def driver(nonce: str, kind: str, spec: dict) -> str:
    """The driver's source for one test (call: fn, args, kwargs; assert: the rewritten code)."""
    return _DRIVER + f"_asyncrl_main({nonce!r}, {kind!r}, json.loads({json.dumps(spec)!r}))\n"


def rewrite_asserts(code: str) -> tuple[str, list[tuple[str, Any, dict]]]:
    """(the test code with probes in place of asserts with a constant side, the checks: per probe
    (op, expected, options)). Raises SyntaxError for code that does not parse."""
    tree = ast.parse(code)
    rewriter = _Rewriter()
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    return ast.unparse(tree), rewriter.checks


class _Rewriter(ast.NodeTransformer):
    def __init__(self):
        self.checks: list[tuple[str, Any, dict]] = []

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        found = _probed(node.test)
        if found is None:
            return node
        expr, op, expected, options = found
        call = ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(len(self.checks)), expr], [])
        self.checks.append((op, expected, options))
        return ast.copy_location(ast.Expr(call), node)


def _probed(test: ast.expr) -> tuple[ast.expr, str, Any, dict] | None:
    """(the expression to probe, op, expected, options) for an assert with a constant side."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, _OPS[type(test.ops[0])], test.comparators[0]
        absdiff = _abs_difference(left)
        if absdiff is not None and op in ("<", "<=") and _is_constant(right):
            return absdiff[0], "absdiff", absdiff[1], {"tol": _constant(right), "strict": op == "<"}
        if _is_constant(right):
            return left, op, _constant(right), {}
        if _is_constant(left):
            return right, _MIRROR[op], _constant(left), {}
    if (isinstance(test, ast.Call) and _dotted(test.func) in ("math.isclose", "isclose")
            and len(test.args) == 2 and all(_is_constant(k.value) for k in test.keywords)):
        options = {k.arg: _constant(k.value) for k in test.keywords if k.arg in ("rel_tol", "abs_tol")}
        if len(options) == len(test.keywords):
            for probe, constant in (test.args, reversed(test.args)):
                if _is_constant(constant):
                    return probe, "isclose", _constant(constant), options
    return None


def _abs_difference(node: ast.expr) -> tuple[ast.expr, Any] | None:
    """abs(<expr> - <constant>) or abs(<constant> - <expr>) -> (<expr>, constant)."""
    if (isinstance(node, ast.Call) and _dotted(node.func) == "abs" and len(node.args) == 1
            and not node.keywords and isinstance(node.args[0], ast.BinOp)
            and isinstance(node.args[0].op, ast.Sub)):
        a, b = node.args[0].left, node.args[0].right
        if _is_constant(b):
            return a, _constant(b)
        if _is_constant(a):
            return b, _constant(a)
    return None


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def _is_constant(node: ast.expr) -> bool:
    try:
        _constant(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def _constant(node: ast.expr) -> Any:
    """The value of a literal, or of set()/tuple()/sorted()/float()... applied to one (at most one
    argument, no keywords): bounded work on what the test's own text holds."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SAFE_CALLS:
        if node.keywords or len(node.args) > 1:
            raise ValueError("not a constant")
        args = [_constant(a) for a in node.args]
        if node.func.id == "bytes" and args and isinstance(args[0], int):
            raise ValueError("bytes(n) allocates n bytes: not a constant worth computing")
        return _SAFE_CALLS[node.func.id](*args)
    return ast.literal_eval(node)


class Opaque:
    """A value the driver could not encode: equal to nothing."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


MAX_SAME_HASH = 64
"""Elements of one decoded set or dict that may share a hash. Python hashes an int as the int
modulo 2**61 - 1, so a program can return thousands of distinct values that all collide, and
building them into a set costs the verifier quadratic CPU time (40,000 of them: 6 s, outside every
limit of the sandbox). An honest value comes nowhere near: distinct small ints never collide."""
VERIFIER_CPU_S = 1.0
"""CPU seconds the verifier spends decoding one report, at most (1 MiB of output decodes in ~0.05 s)."""


class ReportTooCostly(ValueError):
    """A report whose decoding would cost the verifier more than its budget: the test fails with
    outcome `verifier_limit`."""


class _Budget:
    """Checks this thread's CPU time every 1024 values decoded (reading the clock costs ~1 us)."""

    def __init__(self, cpu_s: float):
        self.cpu_s, self.deadline, self.count = cpu_s, time.thread_time() + cpu_s, 0

    def spend(self) -> None:
        self.count += 1
        if self.count % 1024 == 0 and time.thread_time() > self.deadline:
            raise ReportTooCostly(f"decoding the report took over {self.cpu_s:g} CPU-s")


def decode(value: Any, cpu_s: float = VERIFIER_CPU_S) -> Any:
    """A tagged-JSON value (see ENCODER) back as the Python value. Raises ReportTooCostly for a
    value whose sets or dict keys collide in their hashes, or whose decoding runs past cpu_s."""
    return _decode(value, _Budget(cpu_s))


def _decode(value: Any, budget: _Budget) -> Any:
    budget.spend()
    if isinstance(value, list):
        return [_decode(v, budget) for v in value]
    if not isinstance(value, dict):
        return value
    tag, v = value.get("$"), value.get("v")
    if tag == "float":
        return float(v)
    if tag == "complex":
        return complex(_decode(v[0], budget), _decode(v[1], budget))
    if tag == "bytes":
        return v.encode("latin-1")
    if tag in ("list", "tuple"):
        return (list if tag == "list" else tuple)(_decode(x, budget) for x in v)
    if tag in ("set", "frozenset"):
        items = _hashable([_decode(x, budget) for x in v])
        return (set if tag == "set" else frozenset)(items)
    if tag == "dict":
        pairs = [(_decode(k, budget), _decode(x, budget)) for k, x in v]
        _hashable([k for k, _ in pairs])
        return dict(pairs)
    return Opaque()


def _hashable(items: list) -> list:
    """items, once it is sure that no more than MAX_SAME_HASH of them share a hash (TypeError for
    an unhashable one, as the set itself would raise)."""
    counts: dict[int, int] = {}
    for x in items:
        h = hash(x)
        counts[h] = n = counts.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise ReportTooCostly(f"over {MAX_SAME_HASH} values of one set or dict share a hash")
    return items


def check(op: str, actual: Any, expected: Any, options: dict) -> bool:
    """The assert's comparison, made outside; False where Python would raise."""
    try:
        if op == "isclose":
            return math.isclose(actual, expected, **options)
        if op == "absdiff":
            diff = abs(actual - expected)
            return diff < options["tol"] if options["strict"] else diff <= options["tol"]
        return bool(_COMPARE[op](actual, expected))
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False


def probes_pass(reported: list, checks: list[tuple[str, Any, dict]]) -> bool:
    """Whether every probe reported at least once and every report passes its check (raises
    ReportTooCostly, see decode)."""
    if not isinstance(reported, list):
        return False  # the driver writes a list: forged
    seen, budget = set(), _Budget(VERIFIER_CPU_S)  # one budget for the whole report
    for item in reported:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and 0 <= item[0] < len(checks)):
            return False
        op, expected, options = checks[item[0]]
        try:
            actual = _decode(item[1], budget)
            if not check(op, actual, expected, options):
                return False
        except ReportTooCostly:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, OverflowError):
            return False  # not what the driver writes (forged), or a value no check can compare
        seen.add(item[0])
    return len(seen) == len(checks)
