"""The offline tools' engine output goes to a file: what the process and the children it starts
inside the block write, and vLLM's logger afterwards; the console gets its descriptors back."""

import logging
import os
import subprocess
import sys

from asyncrl.offline.engine_log import output_to, vllm_logger_to


def test_the_block_and_the_children_it_starts_write_to_the_file_and_the_console_comes_back(tmp_path, capfd):
    path = tmp_path / "engine.log"
    with open(path, "a", buffering=1) as log:
        with output_to(log):
            os.write(1, b"fd1\n")
            os.write(2, b"fd2\n")
            subprocess.run([sys.executable, "-c", "print('child')"], check=True)
            later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); print('later', flush=True)"])
        os.write(1, b"after\n")
        later.wait()
    text = path.read_text()
    assert {"fd1", "fd2", "child", "later"} <= set(text.split()) and "after" not in text
    out, err = capfd.readouterr()
    assert out == "after\n" and err == ""


def test_the_vllm_logger_writes_to_the_file_from_then_on(tmp_path):
    logger = logging.getLogger("vllm")
    console = logging.StreamHandler(sys.stdout)
    logger.addHandler(console)
    try:
        with open(tmp_path / "engine.log", "a", buffering=1) as log:
            vllm_logger_to(log)
            logger.warning("engine warning")
        assert (tmp_path / "engine.log").read_text() == "engine warning\n"
    finally:
        logger.removeHandler(console)
