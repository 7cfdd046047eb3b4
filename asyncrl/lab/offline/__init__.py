"""Saved policies measured outside training, the library of four commands:

    asyncrl evaluate           evaluate.py: avg@n and pass@k of a run's final/ and checkpoints -> <run>/eval.json
    asyncrl sample             sample.py: a policy's samples on a few prompts and its accuracy
    asyncrl filter-difficulty  difficulty_filter.py: the initial policy's pass rate per prompt; drops
                               the always / never solved
    asyncrl choose-checkpoint  checkpoint_entropy.py: the SFT checkpoint whose token entropy on the
                               RL prompts is in a band

The pure parts (run_policies.py: which policies a run holds and eval.json; difficulty.py: the
pass-rate rule; entropy_band.py: the band rule) import nothing heavy. policy_engine.py is the one
vLLM engine they share across policies (weights swapped over the run's own weight sync), and
sampling and scoring are eval_policy.py's, so every command scores a sample the way a run does.
"""
