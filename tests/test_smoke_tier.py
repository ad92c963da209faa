"""The GPU smoke tier (marker `smoke`, `.ci/device.sh smoke`) keeps what it promises: it names every backend, and
it holds the degree-1 GPU test of every family that test covers. Read from pytest's collection of the gpu tests
(no GPU needed), in a process of its own."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from xstage_dit import available_backends

ROOT = Path(__file__).resolve().parents[1]
DEGREE_ONE = "tests/test_gpu.py::test_degree_one_on_gpu_matches_stock["

# one line per gpu test: "smoke" or "other", then its node id
COLLECT = """
import sys, pytest

class Tiers:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("smoke" if item.get_closest_marker("smoke") else "other", item.nodeid)

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu"], plugins=[Tiers()]))
"""


def test_the_smoke_tier_names_every_backend_and_every_family_at_degree_one():
    result = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    tiers = [line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("smoke ", "other "))]
    smoke = {node for tier, node in tiers if tier == "smoke"}
    words = {word for node in smoke for word in re.findall(r"[a-z0-9]+", node)}
    assert set(available_backends()) <= words, sorted(set(available_backends()) - words)
    degree_one = {node for _, node in tiers if node.startswith(DEGREE_ONE)}
    assert degree_one and degree_one <= smoke, sorted(degree_one - smoke)
