"""The acceptance harness of ``lp-lightning st`` (design spec §16.6, §17): the Q3 matrix, layered
numerics, performance and memory reports. The top layer: it may import anything of lp_lightning and
only ``lp_lightning.cli`` imports it (docs/architecture.md)."""
