import os
import subprocess
import sys


def test_models_load_here_and_in_child_processes_after_hiding_broken_extras():
    # A fresh interpreter hides what it cannot import, then a child it spawns (as vLLM and Ray
    # do) must import transformers' model code too, through the inherited environment.
    code = (
        "from asyncrl.compat import hide_broken_torch_extras; h = hide_broken_torch_extras(); "
        "from transformers import Qwen2ForCausalLM; import subprocess, sys; "
        "r = subprocess.run([sys.executable, '-c', 'from transformers import Qwen2ForCausalLM; "
        "import sys; print(sorted(m for m in (\"torchvision\", \"torchaudio\") if sys.modules.get(m, 0) is None))'], "
        "capture_output=True, text=True); assert r.returncode == 0, r.stderr[-1500:]; print(h); print(r.stdout)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCRL_HIDE_MODULES", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
