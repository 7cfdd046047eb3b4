"""The lab: studies, analysis and offline evaluation, beside the pipeline and never part of it.

    study/     a grid of arms x seeds on a recipe, run as ordinary runs (plan, runner), its study file
               (config) and the whole invocation (conduct: plan, run, evaluate, report)
    analysis/  run directories into curves, statistics over seeds, verdicts, figures and report.md
    offline/   saved policies measured outside training: evaluate (eval.json), sample, the difficulty
               filter, the SFT checkpoint's entropy; one vLLM engine shared across policies

The lab imports the pipeline (config, data, reward, rollout, sync, orchestrator's components) and
the pipeline never imports the lab (tests/unit/test_import_boundaries.py walks the imports). It
starts runs and evaluations as `python -m asyncrl <command>`, never a script by its path, so it
works from an installed package as from a checkout.
"""
