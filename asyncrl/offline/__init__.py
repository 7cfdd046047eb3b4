"""Saved policies measured outside training, the library of three tools:

    tools/evaluate.py          avg@n and pass@k of a run's final/ and checkpoints -> <run>/eval.json
    tools/filter_difficulty.py the initial policy's pass rate per prompt; drops always/never solved
    tools/choose_checkpoint.py the SFT checkpoint whose token entropy on the RL prompts is in a band

The pure parts (run_policies.py: which policies a run holds and eval.json; difficulty.py: the
pass-rate rule; entropy_band.py: the band rule) import nothing heavy. policy_engine.py is the one
vLLM engine they share across policies (weights swapped over the run's own weight sync), and
sampling/scoring is asyncrl/eval_policy.py's, so every tool scores a sample the way a run does.
"""
