"""Every asyncrl.algo module is pure math: it imports with vllm, ray, deepspeed and zmq blocked."""

import pkgutil
import subprocess
import sys

import asyncrl.algo


def test_algo_modules_import_without_heavy_dependencies():
    modules = [f"asyncrl.algo.{m.name}" for m in pkgutil.iter_modules(asyncrl.algo.__path__)]
    assert {"asyncrl.algo.aggregation", "asyncrl.algo.kl", "asyncrl.algo.schedule"} <= set(modules)
    code = (
        "import sys\n"
        "for m in ('vllm', 'ray', 'deepspeed', 'zmq'): sys.modules[m] = None\n"
        f"for m in {modules!r}: __import__(m)\n"
        "bad = [m for m in ('transformers',) if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
