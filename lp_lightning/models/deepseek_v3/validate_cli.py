"""``lp-lightning validate-model``: check a DeepSeek-V3 config against a named spec on meta (§4.1).

Builds ``DeepseekV3ForCausalLM`` on the meta device (no weight is allocated, so the 16B spec takes
well under a second), prints its structure report (layer layout, expert counts, projection shapes,
parameter counts) and validates it with :func:`~lp_lightning.models.deepseek_v3.spec.validate_spec`.

Examples::

    lp-lightning validate-model --spec dsv3-16b
    lp-lightning validate-model --spec dsv3-16b --config_overrides '{"num_hidden_layers": 27}'   # exit 1
    lp-lightning validate-model --spec dsv3-16b --config_path /ckpt/DeepSeek-V3/config.json --json

Exit status: 0 when the model matches the spec, 1 on a spec mismatch (the error names each field,
expected vs actual), 2 on a usage error (unknown spec, malformed JSON, unreadable config).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from jsonargparse import ArgumentParser

from lp_lightning.models.deepseek_v3.report import StructureReport, structure_report
from lp_lightning.models.deepseek_v3.spec import (
    SPECS,
    SpecValidationError,
    build_meta_model,
    inherited_fields,
    validate_spec,
)

__all__ = ["build_parser", "validate_model_main"]

PROG = "lp-lightning validate-model"


def build_parser() -> ArgumentParser:
    """Returns the jsonargparse parser of ``lp-lightning validate-model``."""
    parser = ArgumentParser(
        prog=PROG,
        description="Build a DeepSeek-V3 model on the meta device, print its structure report and "
        "validate it against a named spec (design spec §4.1). Nothing is downloaded or allocated.",
        exit_on_error=False,
    )
    parser.add_argument(
        "--spec",
        type=str,
        default="dsv3-16b",
        metavar="{" + ",".join(sorted(SPECS)) + "}",
        help="Named spec to validate against.",
    )
    parser.add_argument(
        "--config_path",
        type=Optional[str],
        default=None,
        help="Local config.json (or folder holding one) to start from; the spec's fields are applied "
        "on top of it as overrides, as in the §4.1 YAML. Default: the spec alone on DeepseekV3Config defaults.",
    )
    parser.add_argument(
        "--config_overrides",
        type=Optional[dict],
        default=None,
        help='JSON object of DeepseekV3Config fields applied last, e.g. \'{"num_hidden_layers": 27}\'.',
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of text.")
    return parser


def validate_model_main(argv: list[str] | None = None) -> int:
    """Runs ``lp-lightning validate-model`` with ``argv`` (``sys.argv[1:]`` minus the subcommand).

    Args:
        argv: Arguments after ``validate-model``; ``None`` reads ``sys.argv[1:]``.

    Returns:
        Process exit status: 0 valid, 1 spec mismatch, 2 usage/config error. The report goes to
        stdout; errors go to stderr (in ``--json`` mode both are in the JSON object on stdout).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if args.spec not in SPECS:
        legal = ", ".join(sorted(SPECS))
        print(f"{PROG}: error: --spec: invalid choice {args.spec!r} (choose from {legal}).", file=sys.stderr)
        return 2
    overrides = dict(args.config_overrides or {})
    try:
        if args.config_path is None:
            model = build_meta_model(args.spec, config_overrides=overrides)
        else:
            model = build_meta_model(args.config_path, config_overrides={**SPECS[args.spec], **overrides})
        report = structure_report(model)
    except ValueError as err:
        return _fail(args, str(err), status=2, report=None)
    try:
        validate_spec(model, args.spec)
    except SpecValidationError as err:
        return _fail(args, str(err), status=1, report=report, mismatches=err.mismatches)
    inherited = inherited_fields(model.config, args.spec)
    if args.json:
        payload = {
            "spec": args.spec,
            "valid": True,
            "report": report.as_dict(),
            "inherited": {field: {"default": d, "actual": a} for field, (d, a) in inherited.items()},
        }
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(f"spec {args.spec!r}: OK (built on meta, nothing allocated)")
        print(report.format())
        for field, (default, actual) in inherited.items():
            print(f"note: {field}={actual!r} is not a spec field and differs from the default {default!r}")
    return 0


def _fail(
    args: Any,
    message: str,
    *,
    status: int,
    report: StructureReport | None,
    mismatches: tuple[tuple[str, Any, Any], ...] = (),
) -> int:
    """Prints a failure (text to stderr, or the JSON object to stdout) and returns ``status``."""
    if args.json:
        payload = {
            "spec": args.spec,
            "valid": False,
            "error": message,
            "mismatches": [{"field": f, "expected": e, "actual": a} for f, e, a in mismatches],
            "report": report.as_dict() if report is not None else None,
        }
        print(json.dumps(payload, indent=2, default=str))
    else:
        if report is not None:
            print(f"spec {args.spec!r}: MISMATCH; built model:")
            print(report.format())
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(validate_model_main())
