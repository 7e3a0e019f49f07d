"""Tenants, API keys, quotas, limits and usage, knowing nothing of HTTP or torch.

Plain async functions over a database session, one concern a module (`tenants`, `api_keys`,
`auth`, `adapters`, `audit`, `usage`), and a limiter with one meaning whatever its backend
(`tenancy.limiter`: in-process or Redis).
"""
