"""A scenario's modes side by side: the two synchronous baselines (colocated, decoupled), drain
and in-flight asynchronous runs on the split and the colocated asynchronous layout, all with the
real driver in the twin; a table, the summary JSON and a utilisation figure (`asyncrl twin`).

Each ratio in the summary names its baseline: `async_over_sync` is against the colocated
synchronous step (verl's and TRL's placement), `async_over_decoupled` against the synchronous step
on the same split as the asynchronous run (AReaL's synchronous variant, the baseline of its 2.77x)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.twin.cluster import MODES, SYNC_MODES, Twin
from asyncrl.twin.scenario import Scenario

COLUMNS = [("steps_per_s", "steps/s", ".4f"), ("trained_tokens_per_s", "trained tok/s", ",.0f"),
           ("fraction_of_ideal", "of ideal", ".2f"), ("gen_util", "gen busy", ".2f"),
           ("gen_occupancy", "gen occupancy", ".2f"), ("train_util", "train util", ".2f"),
           ("staleness_mean", "stale mean", ".2f"), ("staleness_max", "stale max", ".0f"),
           ("length_bias", "len bias", "+.3f"), ("push_s_mean", "push s", ".2f"),
           ("driver_core_frac", "driver cores", ".3f")]

SUMMARY_KEYS = ["trained_tokens_per_s", "ideal_tokens_per_s", "fraction_of_ideal", "gen_util", "gen_occupancy",
                "reprefill_frac", "train_util",
                "staleness_mean", "staleness_max", "length_bias", "driver_core_frac", "steps_per_s", "keep_frac",
                "stale_dropped_frac", "push_s_mean"]


def run_modes(sc: Scenario, modes: list[str] = list(MODES), charge_driver: bool = True,
              say=print) -> dict[str, dict[str, Any]]:
    out = {}
    for mode in modes:
        say(f"{sc.name}: {mode} ...")
        out[mode] = Twin(sc, mode, charge_driver).run()
    return out


def summary(sc: Scenario, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The last line: the scenario's own asynchronous mode against each synchronous baseline run."""
    main = results.get(sc.run.sync_mode) or next(r for m, r in results.items() if m not in SYNC_MODES)
    out: dict[str, Any] = {"scenario": sc.name, "mode": main["mode"], "gen_gpus": sc.split.gen_gpus,
                           "train_gpus": sc.split.train_gpus, "max_staleness": sc.run.max_staleness,
                           **{k: main[k] for k in SUMMARY_KEYS}}
    rate = main["trained_tokens_per_s"]
    if "sync" in results:  # colocated
        sync = results["sync"]["trained_tokens_per_s"]
        out.update(sync_trained_tokens_per_s=sync, async_over_sync=rate / sync)
    if "sync_decoupled" in results:
        out["async_over_decoupled"] = rate / results["sync_decoupled"]["trained_tokens_per_s"]
    for mode, r in results.items():
        out[f"{mode}_trained_tokens_per_s"] = r["trained_tokens_per_s"]
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'mode':<15}" + "".join(f"{title:>14}" for _, title, _ in COLUMNS)
    rows = [f"{mode:<15}" + "".join(f"{format(r[key], fmt):>14}" for key, _, fmt in COLUMNS)
            for mode, r in results.items()]
    return "\n".join([head, *rows])


def figure(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """GPU utilisation over simulated time, a panel a mode: the engines' mean and the learner's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.4 * len(results)), squeeze=False)
    for ax, (mode, r) in zip(axes[:, 0], results.items()):
        tl = r["timeline"]
        ax.step(tl["t"], tl["gen"], where="post", label="generation GPUs", color="tab:blue")
        ax.step(tl["t"], tl["train"], where="post", label="training GPUs", color="tab:orange")
        ax.axvspan(*tl["window"], color="0.92", zorder=0, label="measured")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
        ax.set_title(f"{mode}: {r['trained_tokens_per_s']:,.0f} trained tokens/s, {r['fraction_of_ideal']:.2f} of ideal",
                     fontsize=9)
    axes[-1, 0].set_xlabel("simulated seconds")
    axes[0, 0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
