"""An agent written elsewhere trains end to end: launch/run.py with env.type agent, the user's
function talking to the rollout actor's OpenAI-compatible endpoint through the real `openai`
client for three chat turns, on the real vLLM engine. What the agent was answered is exactly what
the run trained on: the model turns of the samples it logged are the replies the agent read."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

AGENT = '''
import json, os

import openai


def three_turns(base_url, metadata):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": metadata["prompt_text"]}]
    replies = []
    for follow_up in ("?", "!", None):
        out = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        replies.append(out.choices[0].message.content)
        if follow_up is not None:
            messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": follow_up}]
    with open(os.environ["AGENT_LOG"], "a") as log:
        log.write(json.dumps({"prompt": metadata["prompt_text"], "replies": replies}) + "\\n")
    return float(any(metadata["answer"] in r for r in replies))
'''


def test_an_openai_client_agent_trains_for_three_turns_on_what_it_was_answered(tmp_path, tiny_model_path):
    (tmp_path / "useragent.py").write_text(AGENT)
    log = tmp_path / "agent.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AGENT_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch/run.py"), "name=agent", f"observe.output_dir={tmp_path / 'runs'}",
         "observe.console=lines", "total_steps=3", "eval.every_steps=0", "buffer.token_budget=128",
         "env.type=agent", "env.agent=useragent:three_turns", f"env.import_path=[{tmp_path}]",
         "reward.type=episode", "rollout.max_tokens=40", "observe.samples_per_step=8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs/agent"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("learner/loss_tokens")]
    assert len(trained) == 3 and all(r["episode/turns_mean"] == 3 for r in rows if r.get("episode/turns_mean"))
    assert any(r.get("episode/masked_frac", 0) > 0 for r in rows)  # the follow-ups are in, masked
    logged = {(e["prompt"], tuple(e["replies"])) for e in map(json.loads, log.read_text().splitlines())}
    examples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    examples = [e for e in examples if e.get("turns")]
    assert examples
    for e in examples:
        replies = tuple(t["text"] for t in e["turns"] if t["origin"] == "model")
        assert (e["prompt"], replies) in logged, (e["prompt"], replies)
        assert [t["origin"] for t in e["turns"]] == ["model", "env", "model", "env", "model"]
