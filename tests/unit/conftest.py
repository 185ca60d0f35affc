"""Fixtures shared by the unit tests: the helm binary that renders the chart, and a clock the
test moves (``ticking``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from matrixpool import clock
from tests.unit.chart import test_chart as chart
from tests.unit.clocks import Ticking


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> chart.Helm:
    """The helm that tools/k8s/build.sh built (a cold build takes a while; then it is cached),
    with its cache, config and data kept out of the user's home."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    build = subprocess.run(
        [str(chart.ROOT / "tools" / "k8s" / "build.sh")], capture_output=True, text=True, check=True
    )
    bin_dir = Path(build.stdout.strip().splitlines()[-1])
    return chart.Helm(bin_dir / "helm", {**os.environ, **env})


@pytest.fixture
def ticking(monkeypatch: pytest.MonkeyPatch) -> Ticking:
    """``matrixpool.clock.SYSTEM`` replaced by a :class:`Ticking` clock for the test."""
    fake = Ticking()
    monkeypatch.setattr(clock, "SYSTEM", fake)
    return fake
