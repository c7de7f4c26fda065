"""The suite's grouping works: tests marked ``xdist_group`` share one worker (and so one trained draft, one
sweep, one straight run) only if pytest-xdist can tag them, which some pytest / pytest-xdist pairs silently
stop doing (pytest 9.2 with pytest-xdist 3.8: every group scattered, every shared set-up paid per worker)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite-groups")


def test_grouped_tests_are_tagged_for_one_worker(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@suite-groups"), (
        f"{request.node.nodeid}: pytest-xdist did not tag this xdist_group test, so --dist loadgroup scatters "
        "every group (see the pytest pin in pyproject.toml)")
