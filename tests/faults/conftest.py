"""The fault-injection suite runs only when asked for: `make faults` (pytest -m faults tests/faults -s).
A plain `pytest` over the whole tree skips it (it takes 15-18 minutes of both cores)."""

import pytest


def pytest_collection_modifyitems(config, items):
    if "faults" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="fault-injection suite: run it with `-m faults` (make faults)")
    for item in items:
        if item.get_closest_marker("faults"):
            item.add_marker(skip)
