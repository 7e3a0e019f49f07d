"""`ModelDirectory`: the models this gateway serves and the adapters on them, as a tenant
sees them: which it may use (visibility), an adapter resolved and brought into its engine on
first use, and the tenants' fairness weights pushed to every engine. Read as a mapping, it
is the served base models by name (`ModelEntry`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.engine import EngineStats, LoRAError, ModelBinding
from lockgate.gateway.adapter_catalog import AdapterCatalog, AdapterInfo
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_catalog import ModelInfo
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.visibility import adapter_visible, model_visible

logger = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    name: str
    path: Path
    engine: ModelBinding           # its model (or adapter) on the engine that serves it
    info: ModelInfo                # tokenizer, chat template, context (an adapter's: its base's)
    private: bool = False          # served only to tenants that list it
    created: int = field(default_factory=lambda: int(time.time()))
    parent: str | None = None      # an adapter's base model; `engine` then runs the adapter


def not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


class ModelDirectory(Mapping[str, ModelEntry]):
    def __init__(self, entries: dict[str, ModelEntry], sessions: async_sessionmaker[AsyncSession],
                 adapter_root: Path, adapter_ttl_s: float) -> None:
        self.entries = entries
        self.adapters = AdapterCatalog(sessions, adapter_root, entries, adapter_ttl_s)

    # -- the served base models, as a mapping -------------------------------------------------
    def __getitem__(self, name: str) -> ModelEntry:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    # -- engines ------------------------------------------------------------------------------
    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        return [(name, m.engine.stats()) for name, m in self.entries.items() if m.engine.is_ready]

    def push_weight(self, tenant_id: str, weight: float) -> None:
        """A tenant's fairness weight, in every engine that does not have it yet."""
        for m in self.entries.values():
            if m.engine.tenant_weights.get(tenant_id) != weight:
                m.engine.set_tenant_weight(tenant_id, weight)

    # -- what a tenant sees -------------------------------------------------------------------
    def visible(self, principal: Principal) -> list[ModelEntry]:
        return [m for m in self.entries.values() if model_visible(principal, m.name, private=m.private)]

    def adapter_visible(self, principal: Principal, info: AdapterInfo) -> bool:
        """Whether `principal` may use the adapter: on a base model served here, not being
        deleted here, and allowed by `tenancy.visibility.adapter_visible`."""
        base = self.entries.get(info.base_model)
        if base is None or info.name in self.adapters.deleting:
            return False
        return adapter_visible(principal, info.name, owner_tenant_id=info.owner_tenant_id,
                               base_model=base.name, base_private=base.private)

    def adapter_entry(self, info: AdapterInfo) -> ModelEntry:
        base = self.entries[info.base_model]
        return ModelEntry(info.name, base.path, base.engine.with_adapter(info.name), base.info,
                          private=info.owner_tenant_id is not None,
                          created=info.created, parent=base.name)

    async def visible_adapters(self, principal: Principal) -> list[ModelEntry]:
        """The adapters `principal` may use (none for a key of no tenant, as in `find`)."""
        if principal.tenant_id is None:
            return []
        infos = await self.adapters.listing(principal.tenant_id)
        return [self.adapter_entry(i) for i in infos if self.adapter_visible(principal, i)]

    async def find(self, principal: Principal, name: str) -> ModelEntry | None:
        """A served model or an adapter `principal` may use, by name; None otherwise."""
        entry = self.entries.get(name)
        if entry is not None:
            return entry if model_visible(principal, entry.name, private=entry.private) else None
        if principal.tenant_id is None:
            return None
        info = await self.adapters.lookup(name)
        if info is None or not self.adapter_visible(principal, info):
            return None
        return self.adapter_entry(info)

    async def use_adapter(self, entry: ModelEntry) -> None:
        """Make sure the engine serves the adapter `entry` names (lazily, on first use)."""
        info = await self.adapters.lookup(entry.name)
        if info is None or entry.parent is None:
            raise not_found(entry.name)
        try:
            await self.adapters.register(self.entries[entry.parent], info)
        except (LoRAError, Invalid) as exc:
            logger.error("adapter %s could not be served here: %s", entry.name, exc)
            raise APIError(503, f"The adapter `{entry.name}` cannot be served by this replica "
                           "right now.", code="adapter_unavailable", headers={"retry-after": "5"}) from None
