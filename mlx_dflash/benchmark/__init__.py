"""Side-by-side benchmarks: prompt sets (datasets.py), the harness (runner.py), results
(report.py)."""
