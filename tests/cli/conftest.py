"""Fixtures of the `pagedserve` command's tests."""

from __future__ import annotations

import uuid

import pytest
import redis

from tests.cli.helpers import REDIS_URL


@pytest.fixture
def prefix():
    """A fresh key prefix on the real Redis; every key under it is deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{name}:*", count=500))
    if keys:
        client.delete(*keys)
    client.close()
