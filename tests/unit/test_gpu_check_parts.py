"""tools/gpu_check.py's arithmetic and wheel choice (the whole script runs in
tests/integration/test_gpu_check.py)."""

import importlib.util
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # as an import would: its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_model_flops_by_hand(gpu_check):
    cfg = SimpleNamespace(vocab_size=10, hidden_size=4, num_hidden_layers=2, tie_word_embeddings=True)
    # head 10*4 = 40, body 100 - 40 = 60; 6*60*(3+5) = 2880, 6*40*4 = 960, 6*2*4*(9+25) = 1632
    assert gpu_check.model_flops(cfg, 100, [3, 5], 4) == 2880 + 960 + 1632
    cfg.tie_word_embeddings = False  # an untied input embedding is a lookup, not a matmul: body 100 - 80
    assert gpu_check.model_flops(cfg, 100, [3, 5], 4) == 6 * 20 * 8 + 960 + 1632


def test_peak_is_chosen_by_device_name(gpu_check):
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert gpu_check.peak_flops("NVIDIA H200")[0] == 989e12
    peak, note = gpu_check.peak_flops("Some GPU")
    assert peak is None and "not reported" in note


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="wheel tags of x86_64 Linux")
def test_wheels_that_fit_this_python(gpu_check):
    major, minor = sys.version_info[:2]
    here = f"cp{major}{minor}"
    assert gpu_check.wheel_fits(f"pyyaml-6.0-{here}-{here}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert gpu_check.wheel_fits("pydantic-2.1-py3-none-any.whl")
    assert not gpu_check.wheel_fits(f"pyyaml-6.0-cp{major}{minor - 1}-cp{major}{minor - 1}-manylinux2014_x86_64.whl")
    assert not gpu_check.wheel_fits(f"pyyaml-6.0-{here}-{here}-manylinux2014_aarch64.whl")
    assert gpu_check.wheel_fits(f"pyzmq-27-cp{major}{minor - 1}-abi3-manylinux_2_28_x86_64.whl")  # stable ABI
    assert not gpu_check.wheel_fits(f"pyzmq-27-cp{major}{minor + 1}-abi3-manylinux_2_28_x86_64.whl")
