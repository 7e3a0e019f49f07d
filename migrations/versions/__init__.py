"""Alembic revisions of the tenancy database, oldest first (`0001_initial`, `0002_adapters`)."""
