"""Every command-line tool in tools/ answers `--help`: docs print these commands beside their
figures, and a tool whose imports moved crashed on `--help` unseen (bench_weight_sync.py did)."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
COMMANDS = sorted(p for p in TOOLS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_the_tools_with_a_command_line_are_found():
    names = {p.name for p in COMMANDS}
    assert {"bench_weight_sync.py", "bench_orchestrator.py", "fault_matrix.py", "gpu_check.py"} <= names
    assert "rounds.py" not in names  # a library the benchmarks import, no command line


@pytest.mark.parametrize("tool", COMMANDS, ids=lambda p: p.name)
def test_a_tool_answers_help(tool):
    out = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=TOOLS.parent)
    assert out.returncode == 0 and "usage:" in out.stdout, (out.stdout + out.stderr)[-2000:]
