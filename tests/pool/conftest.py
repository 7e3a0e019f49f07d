"""A local Ray cluster for the pool's tests: a head and a second node process, each lending one
device (`lockgate_device`) and one CPU, on loopback; one per test session."""

from __future__ import annotations

import secrets

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    from ray.cluster_utils import Cluster

    args = {"num_cpus": 1, "resources": {"lockgate_device": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    cluster.add_node(**args)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def namespace() -> str:
    """A namespace of the test's own: its workers and placement are its own."""
    return "lgtest-" + secrets.token_hex(4)
