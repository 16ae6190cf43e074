"""The acceptance harness of ``lp-lightning st`` (design spec §16.6, §17): the Q3 matrix, layered
numerics, performance and memory reports. It may import any layer below the CLI, never the CLI
itself: the dispatcher ``lp_lightning.cli`` (the only module that imports it) hands ``st_main`` the
fit config parser and the entry point (docs/architecture.md)."""
