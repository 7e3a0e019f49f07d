"""A redis-server a test starts on its own port, to hang (SIGSTOP) and resume (SIGCONT):
loadtests/harness/own_redis.py's `OwnRedis`, shared with the chaos bench."""

from __future__ import annotations

from lockgate.loadtests.harness.own_redis import OwnRedis

__all__ = ["OwnRedis"]
