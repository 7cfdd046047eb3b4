"""Studies: a grid of arms x seeds run as ordinary runs (plan.py says which, runner.py runs them,
resumably); asyncrl/lab/analysis/ turns their run directories into figures and a report."""
