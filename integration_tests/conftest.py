"""Fixtures shared by the integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = str(Path(__file__).resolve().parents[1] / "tools")


@pytest.fixture(scope="session")
def stdlib_corpus_cache(tmp_path_factory) -> Path:
    """A data cache directory (``$VESCALE_CACHE``) holding the default corpus (``--data stdlib``) prepared once for
    the session: its byte-level BPE trained and the standard library tokenized (about 6 CPU seconds)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import prepare_data

    cache = tmp_path_factory.mktemp("vescale-cache")
    prepare_data.prepare("stdlib", cache=cache)
    return cache
