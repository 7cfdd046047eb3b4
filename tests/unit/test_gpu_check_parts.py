"""tools/gpu_check.py's arithmetic and wheel choice, in its parts gpu_learner_cases.py and
gpu_setup.py (the whole script runs in tests/integration/test_gpu_check.py)."""

import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def tools():
    """tools/gpu_check.py's parts, imported as the script imports them (tools/ first on the path)."""
    sys.path.insert(0, str(TOOLS))
    import gpu_learner_cases
    import gpu_setup

    yield SimpleNamespace(cases=gpu_learner_cases, setup=gpu_setup)
    sys.path.remove(str(TOOLS))
    for name in ("gpu_learner_cases", "gpu_setup"):
        del sys.modules[name]


def test_model_flops_by_hand(tools):
    cfg = SimpleNamespace(vocab_size=10, hidden_size=4, num_hidden_layers=2, tie_word_embeddings=True)
    # head 10*4 = 40, body 100 - 40 = 60; 6*60*(3+5) = 2880, 6*40*4 = 960, 6*2*4*(9+25) = 1632
    assert tools.cases.model_flops(cfg, 100, [3, 5], 4) == 2880 + 960 + 1632
    cfg.tie_word_embeddings = False  # an untied input embedding is a lookup, not a matmul: body 100 - 80
    assert tools.cases.model_flops(cfg, 100, [3, 5], 4) == 6 * 20 * 8 + 960 + 1632


def test_peak_is_chosen_by_device_name(tools):
    assert tools.cases.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert tools.cases.peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert tools.cases.peak_flops("NVIDIA H200")[0] == 989e12
    peak, note = tools.cases.peak_flops("Some GPU")
    assert peak is None and "not reported" in note


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="wheel tags of x86_64 Linux")
def test_wheels_that_fit_this_python(tools):
    major, minor = sys.version_info[:2]
    here = f"cp{major}{minor}"
    assert tools.setup.wheel_fits(f"pyyaml-6.0-{here}-{here}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert tools.setup.wheel_fits("pydantic-2.1-py3-none-any.whl")
    assert not tools.setup.wheel_fits(f"pyyaml-6.0-cp{major}{minor - 1}-cp{major}{minor - 1}-manylinux2014_x86_64.whl")
    assert not tools.setup.wheel_fits(f"pyyaml-6.0-{here}-{here}-manylinux2014_aarch64.whl")
    assert tools.setup.wheel_fits(f"pyzmq-27-cp{major}{minor - 1}-abi3-manylinux_2_28_x86_64.whl")  # stable ABI
    assert not tools.setup.wheel_fits(f"pyzmq-27-cp{major}{minor + 1}-abi3-manylinux_2_28_x86_64.whl")
