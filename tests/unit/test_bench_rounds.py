"""tools/rounds.py: comparative benchmarks alternate their sides, measure the other load, and
refuse a comparison whose sides saw different load."""

import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from rounds import LoadMeter, alternate, median_ratio, verdict  # noqa: E402


def test_sides_alternate_and_the_ratio_is_the_median_of_each_rounds_pair():
    order, n = [], iter(range(100))
    results = alternate({"a": lambda: order.append("a") or {"rate": 2.0 + next(n)},
                         "b": lambda: order.append("b") or {"rate": 1.0}}, rounds=3, say=lambda _: None)
    assert order == ["a", "b", "a", "b", "a", "b"]
    # a's rates 2, 3, 4 against b's 1: ratios 2, 3, 4, median 3
    assert median_ratio(results, "rate", "a", "b") == 3.0
    assert all("other_cores" in r for rs in results.values() for r in rs)


def test_uneven_or_busy_load_is_refused():
    even = {"a": [{"other_cores": 0.1}, {"other_cores": 0.2}], "b": [{"other_cores": 0.15}, {"other_cores": 0.1}]}
    assert verdict(even) is None
    uneven = {"a": [{"other_cores": 0.1}, {"other_cores": 0.1}], "b": [{"other_cores": 0.9}, {"other_cores": 0.8}]}
    assert "uneven load" in verdict(uneven)
    busy = {"a": [{"other_cores": 0.9}], "b": [{"other_cores": 0.9}]}
    assert "busy" in verdict(busy)


def test_the_load_meter_counts_other_processes_not_this_ones(tmp_path):
    import os
    import signal
    import subprocess

    def spin(seconds: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            pass

    with LoadMeter(every_s=0.05) as own:  # this process and a child spinning: the benchmark's own
        child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.monotonic()\nwhile time.monotonic()-t<0.8: pass"])
        spin(0.8)
        child.wait()
    pid_file = tmp_path / "pid"
    # a spinner outside this process tree: started by a shell that exits at once (double fork)
    subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' & echo $! > {pid_file}"], check=True)
    try:
        with LoadMeter(every_s=0.05) as other:
            time.sleep(0.8)
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert other.other_cores - own.other_cores > 0.4
