"""Tenants, API keys, quotas, limits and usage.

Knows nothing of HTTP or torch: plain async functions over a database session
(`tenancy.service`), and a limiter with one meaning whatever its backend
(`tenancy.limiter`: in-process or Redis).
"""
