"""Accounts of unmet figures: where the time (bytes) goes and what would close the gap.

Issue 14 asks every unmet target to carry a profile-based account in results.json. Write it here,
keyed by figure name or by an ``fnmatch`` pattern (``"step_time/mxfp8/*"``), after profiling the
run that missed; ``python benchmarks/run_all.py --render-only`` re-applies this table to the
committed results.json and rewrites the README tables without measuring again. An account is used
only while its figure is unmet; an unmet figure without one says so in the table.

Example entry::

    "step_time/mxfp8/*": "cProfile of 12 steps (w512, 1 process): emulated GEMMs 40% ... ; "
                         "closing it needs ...",
"""

from __future__ import annotations

import fnmatch
from typing import Any

ACCOUNTS: dict[str, str] = {}
"""Figure name or fnmatch pattern -> account (first match wins: exact names, then patterns in order)."""

NO_ACCOUNT = "unmet; no account yet (profile it and add one to ACCOUNTS in benchmarks/suite/accounts.py)"


def account_for(name: str, accounts: dict[str, str] | None = None) -> str | None:
    """The account of figure ``name``: an exact key, else the first matching pattern, else ``None``."""
    table = ACCOUNTS if accounts is None else accounts
    if name in table:
        return table[name]
    return next((text for pattern, text in table.items() if fnmatch.fnmatchcase(name, pattern)), None)


def apply_accounts(figures: dict[str, dict[str, Any]], accounts: dict[str, str] | None = None) -> None:
    """Sets ``account`` on every unmet figure (``met`` False) in place.

    An account the suite wrote itself (a figure that could not be measured says why:
    ``account_source`` ``"suite"``, see ``suite.common.missing``) is kept; otherwise the :data:`ACCOUNTS` entry, or
    :data:`NO_ACCOUNT`. A met or informational figure loses a table account it no longer needs.
    """
    for name, fig in figures.items():
        if fig.get("account_source") == "suite":
            continue
        if fig.get("met") is False:
            text = account_for(name, accounts)
            fig["account"] = text if text is not None else NO_ACCOUNT
            fig["account_source"] = "ACCOUNTS" if text is not None else "none"
        else:
            fig.pop("account", None)
            fig.pop("account_source", None)
