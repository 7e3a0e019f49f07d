"""The Alembic environment and revisions of the tenancy database (`lockgate db upgrade`;
shipped as package data with `alembic.ini` and `script.py.mako`)."""
