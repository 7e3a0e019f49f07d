"""The Redis limiter's key names (see `tenancy.limiter.redis` for what each key holds).

Every key one request's script touches carries one hash tag, the request's *tag*: the group
(`LimitScope.group`) of its first limited scope, which on Redis Cluster every limited scope of
the request must share (`request_tag`). Redis Cluster then keeps them all in one slot, so the
script runs on the one node that owns it. With prefix ``P`` and tag ``T``:

- a scope whose key is its group (the tenant's ``tenant:T``): ``P{T}:win``, ``:tok``,
  ``:lease``, ``:day:<day>``, ``:month:<month>``;
- another scope ``S`` of group ``T`` (an API key's ``key:K``): ``P{T}S:win`` and so on;
- the request's marker ``P{T}:req:<request id>``, and the tag's pending index ``P{T}:pending``,
  ``P{T}:pending:info``, ``P{T}:pending:res``;
- the tag's epoch ``P{T}:epoch`` (its counters were rebuilt from the usage rows), and a
  refunded request's description ``P{T}:refund:<request id>``.

A scope key never starts with ``:``, and a group's own keys end in the fixed words above, so
no two of these names meet. The one key outside any tag is the registry of tags with pending
admissions, ``Ppending-tags`` (sorted set: tag -> when last registered, on its node's clock),
which `RedisLimiter.expired` walks; it is written by its own small script call, never
together with a request's keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.limiter.base import LimitScope

PARTS = ("win", "tok", "lease")


def scope_base(prefix: str, scope: LimitScope) -> str:
    """The common start of a scope's key names: ``P{T}`` or ``P{T}S``."""
    group = scope.group
    return f"{prefix}{{{group}}}" + ("" if scope.key == group else scope.key)


def counter_base(prefix: str, tag: str, key: str) -> str:
    """`scope_base` of the scope ``key`` in the group ``tag``."""
    return f"{prefix}{{{tag}}}" + ("" if key == tag else key)


def scope_keys(prefix: str, scope: LimitScope, day: str, month: str) -> list[str]:
    """A scope's win, tok, lease, day and month keys (the Lua script's order)."""
    base = scope_base(prefix, scope)
    return [f"{base}:win", f"{base}:tok", f"{base}:lease", f"{base}:day:{day}",
            f"{base}:month:{month}"]


def scope_key(prefix: str, scope: LimitScope, part: str) -> str:
    """One key of a scope: ``part`` is win, tok, lease, ``day:<day>`` or ``month:<month>``
    (for tools that read the limiter's state, e.g. the chaos test's lease watch)."""
    return f"{scope_base(prefix, scope)}:{part}"


def marker(prefix: str, tag: str, request_id: str) -> str:
    return f"{prefix}{{{tag}}}:req:{request_id}"


def pending_keys(prefix: str, tag: str) -> list[str]:
    """The tag's pending index: the sorted set, the info hash and the reserved-tokens hash."""
    base = f"{prefix}{{{tag}}}:pending"
    return [base, f"{base}:info", f"{base}:res"]


def epoch(prefix: str, tag: str) -> str:
    return f"{prefix}{{{tag}}}:epoch"


def refund(prefix: str, tag: str, request_id: str) -> str:
    return f"{prefix}{{{tag}}}:refund:{request_id}"


def registry(prefix: str) -> str:
    """The sorted set of tags that may hold pending admissions."""
    return f"{prefix}pending-tags"


def request_tag(limited: Sequence[LimitScope], *, one_tag: bool) -> str:
    """The tag of a request counted against ``limited`` (not empty): its first scope's group.
    With ``one_tag`` (Redis Cluster) every scope must be of that group, else Invalid."""
    tag = limited[0].group
    if one_tag:
        others = sorted({s.group for s in limited} - {tag})
        if others:
            raise Invalid("scopes", f"on Redis Cluster the limited scopes of one request must "
                                    f"share a tag (LimitScope.tag): {tag!r} and {others}")
    return tag


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise Invalid("prefix", f"must be a string without braces, got {prefix!r}")
    return prefix
