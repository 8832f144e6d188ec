from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cluster import Cluster  # noqa: E402
from _s3 import s3, s3_server  # noqa: E402,F401 - fixtures

_clusters: dict[int, Cluster] = {}


def get_cluster(world_size: int) -> Cluster:
    c = _clusters.get(world_size)
    if c is None or c.broken:
        c = _clusters[world_size] = Cluster(world_size)
    return c


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` -> a live world of ``n`` gloo ranks, shared across tests."""
    yield get_cluster
    for c in _clusters.values():
        c.close()
