"""Analysis of run directories: reading them (runs.py), curves and their statistics over seeds
(curves.py, arms.py), the verdict rules of a study (verdict.py), figures (plots.py, the only
matplotlib importer), report.md (report.py), and all of it into one directory (analyse.py)."""
