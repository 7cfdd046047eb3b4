"""Analysis of run directories: reading them (runs.py), curves and their statistics over seeds
(curves.py, arms.py), the verdict rules of a study (verdict.py), what a figure marks and splits off
(marks.py: events; outliers.py: an arm that would flatten the others), figures (plots.py, the only
matplotlib importer), what differs between the runs' configs (config_diff.py), report.md
(report.py), and all of it into one directory (analyse.py)."""
