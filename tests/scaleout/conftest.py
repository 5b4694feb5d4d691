"""One `pagedserve up --workers 2` stack for the modules that run on it (starting two workers
is most of a module's time): each test leaves it idle, both workers joined, no block held."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def two_workers(tmp_path_factory):
    from tests.scaleout.test_two_workers import Stack

    stack = Stack(tmp_path_factory.mktemp("two-workers"))
    yield stack
    stack.close()
