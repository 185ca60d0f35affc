"""The project's rule for a test that cannot run here: skipped on a developer's machine, a
failure under CI=true (CI runs as root with everything `make test` installs, so a missing
piece there is a broken setup, never a reason to skip)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def cannot_run(reason: str, *, module: bool = False) -> NoReturn:
    """Fail under CI=true, else skip (the whole module with ``module``)."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=module)
