"""tools/bench_learner.py as a user runs it, on the CI-sized `tiny` shape with RL-like lengths: real
learner ranks train as before packing and with packing and the one-pass head, and the last line
is the JSON the benchmark page quotes (packed: no padding; before: the padding RL's spread of
lengths makes)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_learner_bench_compares_its_variants_and_ends_in_its_json_line(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "tools/bench_learner.py", "--configs", "torch-1", "--shape", "tiny",
                           "--lengths", "rl", "--variants", "before", "one-pass-head", "--budget", "4096",
                           "--micro-batch-tokens", "4096", "--steps", "1", "--warmup", "0", "--cores", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"tokens_per_s", "padding_frac", "peak_rss_gib_per_rank", "ranks", "shape"} <= summary.keys()
    assert (summary["shape"], summary["ranks"], summary["variant"], summary["padding_frac"]) == \
        ("tiny", 1, "one-pass-head", 0.0)
    assert summary["tokens_per_s"] > 0 and summary["vs_before"]["before"] == 1.0
    assert summary["vs_before"]["one-pass-head"] > 0
    assert 0 < summary["peak_rss_gib_per_rank"][0] < 8
    padded = next(r for r in json.loads(out.read_text())["results"] if r["variant"] == "before")
    assert padded["padding_frac"] > 0.2  # responses of 1 to 1,024 tokens, four or so to a micro-batch


def test_the_checkpoint_check_resumes_two_ranks_on_the_uninterrupted_losses():
    """--checkpoint on two FSDP2 ranks: each writes its own shard of the moments (half of them
    each), and fresh ranks resumed from the checkpoint compute the uninterrupted run's next two
    losses exactly (the second after an Adam update)."""
    proc = subprocess.run([sys.executable, "tools/bench_learner.py", "--configs", "torch-2", "--shape", "tiny",
                           "--budget", "256", "--steps", "1", "--warmup", "0", "--cores", "2", "--checkpoint"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = json.loads(proc.stdout.strip().splitlines()[-1])["checkpoint"]
    assert sorted(ckpt["state_files_mib"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    halves = [ckpt["state_files_mib"]["__0_0.distcp"], ckpt["state_files_mib"]["__1_0.distcp"]]
    assert abs(sum(halves) - ckpt["full_optimizer_state_mib"]) <= 0.5 and min(halves) > 0.3 * sum(halves)
    # (the save's memory growth is reported, but a tiny model's 4 MiB of moments is within RSS noise:
    # docs/benchmarks.md quotes it on the 0.5B shape)
    assert len(ckpt["save_rss_growth_mib"]) == 2
    assert len(ckpt["loss_after_resumed"]) == 2 and ckpt["loss_after_resumed"][0] != ckpt["loss_after_resumed"][1]
    assert ckpt["resumed_loss_equal"] and ckpt["loss_after_resumed"] == ckpt["loss_after_uninterrupted"]


def test_the_baseline_variant_runs_the_learner_of_the_checkout_it_is_given(tmp_path):
    """--baseline-src: the ranks of the variant `baseline` import asyncrl from that checkout (here
    a copy of this one's package), the other variants from this one, and ratios are against it."""
    shutil.copytree(ROOT / "asyncrl", tmp_path / "base" / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "tools/bench_learner.py", "--configs", "torch-1", "--shape", "tiny",
                           "--variants", "baseline", "packed", "--baseline-src", str(tmp_path / "base"),
                           "--budget", "256", "--steps", "1", "--warmup", "0", "--cores", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    srcs = {r["variant"]: r["src"] for r in json.loads(out.read_text())["results"]}
    assert srcs == {"baseline": str(tmp_path / "base"), "packed": str(ROOT)}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["vs_baseline"]["baseline"] == 1.0 and summary["vs_baseline"]["packed"] > 0
    assert "vs baseline" in proc.stdout
