"""The limiter's connection to Redis, from its URL: one node, a Redis Cluster, or Sentinel.

- ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path``: one
  node, over `redis_pipe.RedisPipe` (one pipelined connection, hiredis).
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://`` for
  TLS): a Redis Cluster, any of its nodes to start from. redis-py's asyncio `RedisCluster`
  learns the slots, sends each script to the node that owns its keys' slot and follows
  MOVED and ASK redirects; one request's keys share a hash tag (`tenancy.limiter.redis_keys`).
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``
  (``rediss+sentinel://``: TLS to the master): the master of Sentinel's ``service``, asked of
  the sentinels and asked again after a failover (redis-py's asyncio `Sentinel`). The URL's
  user and password are the master's; ``?sentinel_password=...`` is the sentinels' own.

Every connection has the same face as `RedisPipe`: ``execute(*args)``, ``where`` (for
messages), ``one_slot`` (whether one script's keys must share a slot) and ``aclose()``. Every
wait is bounded by ``timeout``: for one node, the connect and each reply; with redis-py's
clients each socket connect and read (``socket_connect_timeout``, ``socket_timeout``), and a
whole call, with the slot map or master address it may fetch first and one redirect or retry,
by ``CLIENT_CALL_WAITS`` x ``timeout``. No call is retried blindly: one whose reply was lost
may have run. Failures are redis-py's exception types
(`redis.exceptions.RedisError`); the client's own errors (no node for a slot) are raised as
`redis.exceptions.ConnectionError`, a call past its bound as `redis.exceptions.TimeoutError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from lockgate.tenancy.errors import Invalid

CLIENT_CALL_WAITS = 4
"""A call through redis-py's Cluster or Sentinel client waits at most this many timeouts."""

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


class Connection(Protocol):
    where: str
    one_slot: bool

    async def execute(self, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class MultiHostUrl:
    """A ``redis+cluster://`` or ``redis+sentinel://`` URL, parsed."""

    tls: bool
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    path: tuple[str, ...]           # the URL's path segments (Sentinel: service, db)
    query: dict[str, str]


def parse_multi_host(url: str) -> MultiHostUrl:
    """Parse ``scheme://[user:password@]host:port[,host:port...][/path][?query]``."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    hosts = []
    for item in hostlist.split(","):
        if item.startswith("["):                          # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        host = host or "localhost"
        try:
            hosts.append((host, int(port) if port else 6379))
        except ValueError:
            raise Invalid("redis_url", f"bad host:port {item!r} in {_redact(url)}") from None
    if not hostlist:
        raise Invalid("redis_url", f"no host in {_redact(url)}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    path = tuple(unquote(p) for p in parts.path.split("/") if p)
    return MultiHostUrl(parts.scheme.startswith("rediss"), tuple(hosts), username, password,
                        path, query)


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


def connect(url: str, *, timeout: float) -> Connection:
    """The connection ``url`` names (see the module docstring); nothing is opened yet."""
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme in CLUSTER_SCHEMES:
        return _cluster(parse_multi_host(url), timeout)
    if scheme in SENTINEL_SCHEMES:
        return _sentinel(parse_multi_host(url), timeout)
    from lockgate.tenancy.limiter.redis_pipe import RedisPipe

    return RedisPipe(url, timeout=timeout)


def _retry() -> Any:
    """No retries: a script whose reply was lost may have run (an acquire must not run twice);
    the client still follows MOVED and ASK, which mean the command did not run."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Retry(NoBackoff(), 0)


def _cluster(u: MultiHostUrl, timeout: float) -> ClientConnection:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in u.hosts], username=u.username,
        password=u.password, ssl=u.tls, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=_retry())
    where = ",".join(f"{h}:{p}" for h, p in u.hosts) + " (Redis Cluster)"
    return ClientConnection(client, where, timeout, one_slot=True)


def _sentinel(u: MultiHostUrl, timeout: float) -> ClientConnection:
    from redis.asyncio.sentinel import Sentinel

    if not u.path or len(u.path) > 2:
        raise Invalid("redis_url", "a Sentinel URL names its service: "
                                   "redis+sentinel://host:port[,host:port...]/service[/db]")
    service = u.path[0]
    try:
        db = int(u.path[1]) if len(u.path) > 1 else 0
    except ValueError:
        raise Invalid("redis_url", f"the database must be a number, got {u.path[1]!r}") from None
    socket = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    sentinel_kw: dict[str, Any] = dict(socket)
    if "sentinel_password" in u.query:
        sentinel_kw["password"] = u.query["sentinel_password"]
    sentinel = Sentinel(list(u.hosts), sentinel_kwargs=sentinel_kw, **socket)
    client = sentinel.master_for(service, db=db, username=u.username, password=u.password,
                                 ssl=u.tls, retry=_retry())
    where = ",".join(f"{h}:{p}" for h, p in u.hosts) + f" (Sentinel, master {service!r})"
    return ClientConnection(client, where, timeout, one_slot=False, extra=sentinel)


class ClientConnection:
    """`RedisPipe`'s face on a redis-py asyncio client (Cluster, or Sentinel's master)."""

    def __init__(self, client: Any, where: str, timeout: float, *, one_slot: bool,
                 extra: Any = None) -> None:
        self.client = client
        self.where = where
        self.timeout = timeout
        self.one_slot = one_slot
        self._extra = extra             # the Sentinel manager, whose clients close with ours
        self._initialized = not one_slot
        self._init_lock: asyncio.Lock | None = None

    async def _initialize(self) -> None:
        """Learn the cluster's slots once, before any command: redis-py's `RedisCluster` has
        its first commands, sent at once, each start on the startup nodes while the first one
        replaces them, and some then fail on closed connections."""
        if self._init_lock is None:
            self._init_lock = asyncio.Lock()
        async with self._init_lock:
            if not self._initialized:
                await self.client.initialize()
                self._initialized = True

    async def execute(self, *args: Any) -> Any:
        bound = CLIENT_CALL_WAITS * self.timeout
        try:
            async with asyncio.timeout(bound):
                if not self._initialized:
                    await self._initialize()
                return await self.client.execute_command(*args)
        except TimeoutError:
            raise RedisTimeoutError(f"{self.where} did not answer within {bound:g} s") from None
        except RedisClusterException as exc:    # not a RedisError: no node for the slot, ...
            raise RedisConnectionError(f"{self.where}: {exc}") from exc

    async def aclose(self) -> None:
        await self.client.aclose()
        for s in getattr(self._extra, "sentinels", ()):
            await s.aclose()
