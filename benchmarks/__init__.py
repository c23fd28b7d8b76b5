"""Benchmarks of the source checkout (not installed with trainbridge): the peer bench in ``bench/``,
the hand-written baselines it runs in ``baselines/``, and the results in the Markdown files."""
