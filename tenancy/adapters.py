"""LoRA adapter rows: the path check against the adapter root, registration, lookups (all, a
tenant's own and the public ones, by id or name) and deletion, audited like every change."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy import audit
from lockgate.tenancy.db import in_transaction, is_unique_violation
from lockgate.tenancy.errors import Invalid, NotFound
from lockgate.tenancy.models import Adapter, Tenant, new_adapter_id, utcnow
from lockgate.tenancy.validation import MODEL_NAME_MAX, check_actor, check_name, check_str_list

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(//|$)|^file:")


def adapter_path(root: Path, path: Any) -> tuple[str, Path]:
    """Check an adapter's `path` against the adapter `root`: (the path relative to the root,
    as stored; the resolved directory). A URL, a `..` part, an absolute path elsewhere or a
    symbolic link leading out of the root is refused (Invalid "path"); so is a missing
    directory. Symbolic links inside the root are resolved, so the stored path cannot be
    redirected later."""
    if not isinstance(path, str) or not path.strip():
        raise Invalid("path", f"must be a non-empty path relative to the adapter root ({root})")
    if "\x00" in path or len(path) > 1024:
        raise Invalid("path", "must be at most 1024 characters, without NUL")
    if _URL_RE.match(path):
        raise Invalid("path", f"{path!r} is a URL; give a directory inside the adapter root ({root})")
    given = Path(path)
    if ".." in given.parts:
        raise Invalid("path", f"{path!r} must not contain '..'; give a directory inside the "
                              f"adapter root ({root})")
    root_real = root.resolve()
    real = (given if given.is_absolute() else root / given).resolve()
    if real == root_real or not real.is_relative_to(root_real):
        how = " (a symbolic link leads out of it)" if not given.is_absolute() else ""
        raise Invalid("path", f"{path!r} is outside the adapter root, {root_real}{how}; copy or "
                              "link the adapter there (LOCKGATE_ADAPTER_ROOT sets the root)")
    if not real.is_dir():
        raise Invalid("path", f"{path!r} is not a directory in the adapter root ({root_real})")
    return real.relative_to(root_real).as_posix(), real


def _check_base_model(base_model: Any) -> str:
    if not isinstance(base_model, str) or not 1 <= len(base_model) <= MODEL_NAME_MAX:
        raise Invalid("base_model", f"must be a model name of 1 to {MODEL_NAME_MAX} characters")
    return base_model


def adapter_detail(a: Adapter) -> dict[str, Any]:
    """What the audit log keeps of a deleted adapter."""
    return {"name": a.name, "base_model": a.base_model, "owner_tenant_id": a.owner_tenant_id,
            "path": a.path}


async def check_new_adapter(session: AsyncSession, *, name: str,
                            owner_tenant_id: str | None) -> None:
    """Invalid unless `name` is free and the owner (None: public) is a live tenant."""
    check_name(name)
    taken = await session.scalar(select(Adapter.id).where(Adapter.name == name))
    if taken is not None:
        raise Invalid("name", f"an adapter named {name!r} already exists")
    if owner_tenant_id is not None:
        tenant = await session.get(Tenant, owner_tenant_id, populate_existing=True)
        if tenant is None or tenant.deleted_at is not None:
            raise Invalid("owner_tenant_id", f"tenant {owner_tenant_id!r} does not exist "
                                             "(or is deleted)")


async def create_adapter(
    session: AsyncSession,
    *,
    name: str,
    base_model: str,
    owner_tenant_id: str | None,
    path: str,
    rank: int,
    targets: Sequence[str],
    actor: str,
    adapter_id: str | None = None,
) -> Adapter:
    """Register an adapter (its files checked by the caller, `path` relative to the root;
    `adapter_id` chosen by the caller or generated). Invalid if the name is taken or the
    owner is not a live tenant."""
    check_actor(actor)
    _check_base_model(base_model)
    target_list = check_str_list(targets, "targets")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise Invalid("rank", f"must be an integer >= 1, got {rank!r}")

    async def work() -> Adapter:
        await check_new_adapter(session, name=name, owner_tenant_id=owner_tenant_id)
        adapter = Adapter(id=adapter_id or new_adapter_id(), name=name, base_model=base_model,
                          owner_tenant_id=owner_tenant_id, path=path, rank=rank,
                          targets=target_list, created_at=utcnow())
        session.add(adapter)
        await session.flush()
        audit.record(session, actor, "adapter.create", "adapter", adapter.id, {
            "name": name, "base_model": base_model, "owner_tenant_id": owner_tenant_id,
            "path": path, "rank": rank, "targets": target_list,
        })
        return adapter

    try:
        return await in_transaction(session, work)
    except IntegrityError as exc:
        if is_unique_violation(exc, "name"):
            raise Invalid("name", f"an adapter named {name!r} already exists") from None
        raise


async def list_adapters(session: AsyncSession) -> list[Adapter]:
    """Every adapter, by name (the admin's view)."""
    return list((await session.scalars(select(Adapter).order_by(Adapter.name))).all())


async def list_tenant_adapters(session: AsyncSession, tenant_id: str) -> list[Adapter]:
    """The adapters a tenant may see: its own and the public ones, by name."""
    stmt = (select(Adapter)
            .where(or_(Adapter.owner_tenant_id.is_(None), Adapter.owner_tenant_id == tenant_id))
            .order_by(Adapter.name))
    return list((await session.scalars(stmt)).all())


async def get_adapter(session: AsyncSession, adapter_id: str) -> Adapter:
    """The adapter with this id; NotFound otherwise."""
    adapter = await session.get(Adapter, adapter_id, populate_existing=True)
    if adapter is None:
        raise NotFound("adapter", adapter_id)
    return adapter


async def find_adapter(session: AsyncSession, name: str) -> Adapter | None:
    """The adapter named `name`, or None."""
    stmt = select(Adapter).where(Adapter.name == name).execution_options(populate_existing=True)
    return await session.scalar(stmt)


async def adapter_ids_by_name(session: AsyncSession, names: Iterable[str]) -> dict[str, str]:
    """name -> id of those of `names` that are registered."""
    names = list(names)
    if not names:
        return {}
    rows = await session.execute(select(Adapter.name, Adapter.id).where(Adapter.name.in_(names)))
    return {name: aid for name, aid in rows}


async def delete_adapter(session: AsyncSession, adapter_id: str, *, actor: str) -> Adapter:
    """Delete an adapter's row (usage rows keep its name as their model)."""
    check_actor(actor)

    async def work() -> Adapter:
        adapter = await get_adapter(session, adapter_id)
        audit.record(session, actor, "adapter.delete", "adapter", adapter.id,
                     adapter_detail(adapter))
        await session.delete(adapter)
        await session.flush()
        return adapter

    return await in_transaction(session, work)
