"""asyncrl vs TRL's GRPOTrainer on the built-in task: samples/s and reward gained per second.

    pip install -e ".[cpu,bench]"          # TRL is a benchmark dependency, not a core one
    python tools/bench_vs_trl.py --steps 100 [--rounds 3] [asyncrl overrides ...]

Both train the default tiny model from the same start on the same training prompts, scored by
the same verifier (asyncrl's reward router, called in TRL's process), with the same group size
(8), 8 prompts = 64 samples per TRL step (about what one Phi = 512 asyncrl step holds), the same
max response length (16), temperature 1, learning rate, clip-higher (eps 0.2 / 0.28), no KL
term, one optimizer step per generation batch. TRL generates with HF `generate` in its
process, as its plain trainer does; asyncrl with its vLLM actor, asynchronously. Same cores:
torch uses every core in TRL's process; asyncrl's default run spreads them over its processes.

Start-up is excluded on both sides: rates run over the steps after the first `--warmup`.
samples/s counts the samples generated and scored; loss tokens/s the response tokens that entered
a loss (TRL: every completion token; asyncrl: Phi a step, after dropping zero-variance groups and
stale tokens); reward gain per second is the mean reward of the last fifth of steps minus the
first fifth, over the wall time of the run's steps.

The sides alternate (TRL, asyncrl, TRL, ...) for `--rounds` rounds, each recording the cores
other processes used meanwhile (tools/rounds.py): a torch process with two threads slows
several-fold beside other work on two cores. Prints every round, the medians and the median of
the rounds' ratios asyncrl / TRL; refuses to report them when the sides saw different load.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from loop_bench import reward_gain as gain
from loop_bench import run_loop
from rounds import alternate, report

GROUP, PROMPTS, MAX_TOKENS, LR = 8, 8, 16, 3e-4
KEYS = ("samples_per_s", "loss_tokens_per_s", "reward_gain", "gain_per_s", "wall_s", "other_cores")


def run_trl(steps: int, warmup: int) -> dict:
    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config import load_config
    from asyncrl.reward.registry import RewardRouter
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model, train_records

    spec = TinyModelSpec()
    path = str(ensure_tiny_model(spec))
    router = RewardRouter(load_config(None, []).reward)
    records = train_records(spec)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "data_source": r["data_source"]}
                                 for r in records])

    def reward(prompts, completions, answer, data_source, **_):
        return [router(c, {"answer": a, "data_source": s})[0] for c, a, s in zip(completions, answer, data_source)]

    class Clock(TrainerCallback):
        """Wall time and mean reward of every step."""

        def __init__(self):
            self.step_end: list[float] = []
            self.rewards: list[float] = []
            self.tokens: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.step_end.append(time.monotonic())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                self.tokens.append(float(logs["completions/mean_length"]) * GROUP * PROMPTS)

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=GROUP * PROMPTS,
            num_generations=GROUP, max_completion_length=MAX_TOKENS, learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, epsilon=0.2, epsilon_high=0.28, beta=0.0,
            temperature=1.0, num_iterations=1, gradient_accumulation_steps=1, logging_steps=1,
            max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", seed=0,
            loss_type="dapo", disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock])
        trainer.remove_callback(PrinterCallback)  # a dict a step on stdout; the Clock keeps what we need
        trainer.train()
    timed = clock.step_end[warmup:]
    wall = timed[-1] - timed[0]
    return {"samples_per_s": (len(timed) - 1) * GROUP * PROMPTS / wall,
            "loss_tokens_per_s": sum(clock.tokens[warmup + 1:]) / wall, "reward_gain": gain(clock.rewards),
            "gain_per_s": gain(clock.rewards) / (clock.step_end[-1] - clock.step_end[0]),
            "reward_first": clock.rewards[0], "steps": len(clock.step_end), "wall_s": clock.step_end[-1] - clock.step_end[0]}


def run_asyncrl(steps: int, warmup: int, overrides: list[str]) -> dict:
    r = run_loop("vs-trl", steps, warmup, [f"rollout.group_size={GROUP}", f"rollout.max_tokens={MAX_TOKENS}",
                                           f"learner.lr={LR}", "eval.every_steps=0", *overrides])
    history = r["orchestrator"].history
    rewards = [h["reward/mean"] for h in history if h.get("reward/mean") is not None]
    timed = history[warmup:]
    wall = sum(h["timing/step_wall_s"] for h in timed)
    all_wall = sum(h["timing/step_wall_s"] for h in history)
    return {"samples_per_s": sum(h["reward/num_samples"] for h in timed) / wall,
            "loss_tokens_per_s": sum(h["learner/loss_tokens"] for h in timed) / wall, "reward_gain": gain(rewards),
            "gain_per_s": gain(rewards) / all_wall, "reward_first": rewards[0], "steps": len(history), "wall_s": all_wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="asyncrl config overrides")
    args = p.parse_args()
    t0 = time.monotonic()
    results = alternate({"trl": lambda: run_trl(args.steps, args.warmup),
                         "asyncrl": lambda: run_asyncrl(args.steps, args.warmup, args.overrides)}, args.rounds)
    report(results, KEYS, ("samples_per_s", "loss_tokens_per_s", "gain_per_s"), "asyncrl", "trl", t0)


if __name__ == "__main__":
    main()
