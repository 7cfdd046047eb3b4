"""The offline tools' engine output goes to a file: what the process and the children it starts
inside the block write, and vLLM's logger afterwards; the console gets its descriptors back."""

import io
import logging
import os
import subprocess
import sys

from asyncrl.lab.offline.engine_log import output_to, vllm_logger_to


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


def test_the_vllm_logger_writes_to_the_file_from_then_on_and_only_its_console_handlers_move(tmp_path, capsys):
    logger = logging.getLogger("vllm")
    console, captured = logging.StreamHandler(sys.stdout), logging.StreamHandler(io.StringIO())
    logger.addHandler(console)
    logger.addHandler(captured)
    try:
        with open(tmp_path / "engine.log", "a", buffering=1) as log:
            moved = vllm_logger_to(log)
            try:
                logger.warning("engine warning")
                assert console in moved and captured not in moved and console.stream is log
            finally:
                for handler, stream in moved.items():  # other tests' handlers: back as they were
                    handler.setStream(stream)
        assert "engine warning" in (tmp_path / "engine.log").read_text()
        assert "engine warning" not in capsys.readouterr().out
        assert captured.stream.getvalue() == "engine warning\n"
    finally:
        logger.removeHandler(console)
        logger.removeHandler(captured)
