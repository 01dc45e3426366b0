"""celery-exclusive's benchmark suite: ``.venv/bin/python -m benchmarks [--quick]``.

Every comparison is a ratio of two approaches measured side by side in one run: the
approaches of a section take turns in each round (the starting one rotates), and a ratio
is the median of the per-round ratios, so machine drift between rounds cancels out.
See BENCHMARKS.md for what each row means and the latest results.
"""
