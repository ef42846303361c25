"""Suite-wide fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_report_header() -> str:
    """Which segflow the suite tests: CI tests the installed wheel, a developer the
    editable install of the source tree."""
    import segflow

    return f"segflow: {os.path.dirname(segflow.__file__)}"


@pytest.fixture(autouse=True, scope="session")
def _private_package_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the suite off the user's inductor package cache (``~/.cache/segflow``).

    Under ``compile="auto"`` a small segment runs a package it finds there, so a
    developer's earlier ``--compile inductor`` runs would change what the tests run.
    """
    before = os.environ.get("SEGFLOW_CACHE_DIR")
    os.environ["SEGFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("segflow-cache"))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SEGFLOW_CACHE_DIR", None)
        else:
            os.environ["SEGFLOW_CACHE_DIR"] = before
