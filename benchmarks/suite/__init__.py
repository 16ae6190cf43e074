"""Building blocks of ``benchmarks/run_all.py`` (issue 14's benchmark suite); see ``benchmarks/README.md``.

- :mod:`suite.common`: figures (the results.json schema), timing statistics, the machine block;
- :mod:`suite.training`: ``lp-lightning fit`` runs and the step-time / compile / thread / wire /
  memory figures read from their ``run_summary.json``;
- :mod:`suite.report`: results.json and the results table between marker comments (benchmarks/README.md,
  docs/performance.md);
- :mod:`suite.accounts`: the profile-based accounts of unmet figures (edited by hand).
"""
