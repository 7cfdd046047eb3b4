"""tools/parity_floor.py as the sync guide runs it, on the default tiny model: its measured bf16
floor is real (above float32 rounding) and within the one the default tolerances are built from."""

import json
import subprocess
import sys
from pathlib import Path

from asyncrl.config.sync_section import ROUNDING_FLOOR_NATS

ROOT = Path(__file__).resolve().parents[2]


def test_parity_floor_measures_the_tiny_model_within_the_configured_floor(tiny_model_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools/parity_floor.py"), "--model", tiny_model_path,
                          "--sequences", "8", "--max-new-tokens", "12"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    (row,) = doc["models"]
    assert row["model"] == tiny_model_path and row["tokens"] >= 8 * 12
    assert 1e-3 < row["max_abs"] == doc["floor_bf16"] <= ROUNDING_FLOOR_NATS["bfloat16"]
    assert row["mean_abs"] <= row["p99_abs"] <= row["max_abs"]
    assert doc["tolerance_bf16_both"] == 2 * doc["floor_bf16"]
