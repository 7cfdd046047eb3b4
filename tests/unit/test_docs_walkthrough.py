"""The data the own-data walk-through generates (docs/guides/own-data-and-rewards.md) makes a
held-out split that measures something: the guide's `python - <<'PY'` block is run as shown.

Holding out every sixth row of the a-then-b order once gave `0*0=` to `5*0=`, every answer 0, and a
held-out score that only measured x*0 = 0 (docs/research/findings.md#your-own-data-the-walk-through)."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_commands import ROOT, commands_in  # noqa: E402

GUIDE = ROOT / "docs/guides/own-data-and-rewards.md"


def generate(cwd: Path) -> tuple[list[dict], list[dict]]:
    """Run the guide's generator in cwd; (train rows, held-out rows)."""
    (block,) = [c.heredoc for c in commands_in(GUIDE) if c.text == "python - <<'PY'"]
    proc = subprocess.run([sys.executable, "-c", block], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    read = lambda name: [json.loads(x) for x in (cwd / name).read_text().splitlines()]  # noqa: E731
    return read("train.jsonl"), read("heldout.jsonl")


def test_the_walkthrough_holds_out_varied_problems_it_does_not_train_on(tmp_path):
    train, heldout = generate(tmp_path)
    questions = [r["question"] for r in train + heldout]
    assert len(set(questions)) == len(questions) == 36, "every product once, in one split or the other"
    assert 0 < len(heldout) < len(train)
    answers = {r["solution"] for r in heldout}
    assert len(answers) > 1, f"every held-out answer is {answers}: the held-out score measures one rule"


def test_the_walkthrough_split_is_the_same_every_time(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert generate(tmp_path / "a") == generate(tmp_path / "b")
