"""``python -m lp_lightning.telemetry > docs/run_summary.md``: print the run-summary page generated from the schema."""

from lp_lightning.telemetry.schema import schema_markdown

print(schema_markdown(), end="")
