import logging

from asyncrl.sync.vllm_gloo_engine import BenignReloadWarnings


def record(layer: str, msg: str = "%s: Failed to load weights") -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, (layer,), None)


def test_only_the_expected_reload_warnings_are_dropped():
    tied, untied = BenignReloadWarnings(tied_head=True), BenignReloadWarnings(tied_head=False)
    assert not tied.filter(record("RotaryEmbedding")) and not untied.filter(record("RotaryEmbedding"))
    assert not tied.filter(record("ParallelLMHead"))
    assert untied.filter(record("ParallelLMHead"))  # an untied head that fails to load is a real problem
    assert tied.filter(record("QKVParallelLinear"))
    assert tied.filter(record("RotaryEmbedding", "%s: Delayed processing"))
