"""What tools/gpu_check.py needs before it can measure anything on a lent GPU machine: the wheels of
what asyncrl imports and the machine lacks, unpacked from .whl/ onto the path (see gpu_check.py's
docstring), and its pytest parts, each run in a subprocess under a time limit and read back from
its JUnit report; and `guarded`, which runs each part so that one that fails is recorded and the
next one runs. Standard library only: it runs before those wheels are on the path."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("pydantic", "yaml", "zmq")  # what asyncrl imports that the GPU machine lacks
OPTIONAL = ("deepspeed",)  # carried too (a wheel built from its sdist), for learner.backend=deepspeed
TESTS = ["tests/integration/test_learner_cuda.py", "tests/unit/test_learner_precision.py",
         "tests/unit/test_nccl_packing.py"]
# DeepSpeed's cases run last, on their own: a JIT build it might attempt must not cost the others
PYTEST_RUNS = {"pytest": (TESTS, "not deepspeed"), "pytest_deepspeed": (TESTS[:1], "deepspeed")}

# -- wheels -----------------------------------------------------------------------------------

def wheel_fits(name: str) -> bool:
    """Whether a wheel file installs on this interpreter (CPython x.y, Linux x86_64 or pure)."""
    py_tags, abi, plat = name[:-4].split("-")[-3:]
    here = sys.version_info[:2]
    if plat != "any" and not (sys.platform == "linux" and plat.endswith(platform.machine())):
        return False
    for tag in py_tags.split("."):
        if tag in ("py3", f"py{here[0]}{here[1]}") or tag == f"cp{here[0]}{here[1]}":
            return True
        if abi == "abi3" and tag.startswith("cp3") and int(tag[3:]) <= here[1]:
            return True
    return False


def use_carried_wheels() -> list[str]:
    """Unpack .whl/'s wheels for this Python, first on sys.path and PYTHONPATH; returns them."""
    if all(importlib.util.find_spec(m) for m in NEEDED + OPTIONAL):
        return []
    wheels = sorted(w for w in (ROOT / ".whl").glob("*.whl") if wheel_fits(w.name))
    if not wheels:
        missing = [m for m in NEEDED if not importlib.util.find_spec(m)]
        raise SystemExit(f"gpu_check: {missing} not installed and no fitting wheel in {ROOT / '.whl'} "
                         "(carry .whl; see the docstring)")
    target = Path(tempfile.gettempdir()) / f"asyncrl-wheels-py{sys.version_info[0]}{sys.version_info[1]}"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                path = z.extract(info, target)
                mode = info.external_attr >> 16
                if mode & 0o111:  # zip extraction drops the execute bit (ninja's binary needs it)
                    os.chmod(path, mode & 0o777)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    missing = [m for m in NEEDED if not importlib.util.find_spec(m)]
    if missing:
        raise SystemExit(f"gpu_check: no wheel in {ROOT / '.whl'} provides {missing} for Python "
                         f"{platform.python_version()} (the folder holds CPython 3.10-3.12 wheels)")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return [w.name for w in wheels]


# -- (a) pytest -------------------------------------------------------------------------------

def run_pytest(out: Path, name: str, collect_only: bool, timeout_s: float) -> dict:
    import xml.etree.ElementTree as ET

    tests, selection = PYTEST_RUNS[name]
    report = out / f"gpu_check_{name}_junit.xml"
    cmd = [sys.executable, "-m", "pytest", *tests, "-k", selection, "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={report}"]
    if collect_only:
        cmd.append("--collect-only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(ROOT)]).strip(os.pathsep)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # its output so far may come back as bytes
        partial = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr)]
        text, rc = "".join(partial) + f"\nTIMEOUT after {timeout_s:.0f}s", -1
    (out / f"gpu_check_{name}.txt").write_text(text)
    result = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": text.strip().splitlines()[-1:]}
    if report.is_file() and not collect_only:
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        result["not_passed"] = [
            f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}"
            for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error", "skipped")]
    result["ok"] = rc in (0, 5)  # 5: nothing selected, e.g. DeepSpeed's cases without CUDA
    return result


def guarded(summary: dict, key: str, fn, *args):
    t0 = time.monotonic()
    try:
        result = fn(*args)
    except BaseException as e:  # record and go on: one device run must report every part it can
        if isinstance(e, KeyboardInterrupt):
            raise
        summary[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-3000:]}
        return None
    if isinstance(result, tuple):
        result, extra = result
    else:
        extra = None
    result["seconds"] = round(time.monotonic() - t0, 1)
    summary[key] = result
    return extra
