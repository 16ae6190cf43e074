"""The acceptance harness ``lp-lightning st`` (design spec §16.6, §17): the Q3 matrix, layered numerics, reports."""
