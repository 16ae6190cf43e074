"""Fixtures of the Lightning-layer tests: a shared token cache (``isolated_dist`` is in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from lp_lightning.data import build_token_cache


@pytest.fixture(scope="session")
def token_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A token cache of the default stdlib corpus (byte tokenizer), built once per session."""
    path = tmp_path_factory.mktemp("tokens")
    build_token_cache(None, "byte", path)
    return str(path)
