"""Tenants, API keys, quotas, limits and usage, knowing nothing of HTTP or torch.

Plain async functions over a database session, one concern a module (`tenants`, `api_keys`,
`auth`, `adapters`, `audit`, `usage`), and a limiter with one meaning whatever its backend
(`tenancy.limiter`: in-process or Redis).
"""

if not __name__.startswith("lockgate."):
    # The repository's top-level folders are importable only as parts of the lockgate namespace,
    # so that no module is loaded twice under two names.
    raise ImportError(f"{__name__!r} is part of Lockgate: import it as 'lockgate.{__name__}'")
