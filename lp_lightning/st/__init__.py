"""The acceptance harness of design spec §16.6 and §17 (``lp-lightning st``): the Q3-01 … Q3-11 matrix, reports."""
