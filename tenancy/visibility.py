"""Which models and adapters a tenant may use: pure rules over the tenant's model list and a
model's or adapter's owner and privacy (no I/O; the gateway supplies what it serves)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class Viewer(Protocol):
    """Whoever asks (a `Principal`): its tenant (None: an admin key) and model list (None:
    every model that is not private)."""

    @property
    def tenant_id(self) -> str | None: ...

    @property
    def models(self) -> Collection[str] | None: ...


def model_visible(viewer: Viewer, name: str, *, private: bool) -> bool:
    """A tenant with a model list uses the models it names; one without, every model that is
    not private."""
    if viewer.models is not None:
        return name in viewer.models
    return not private


def adapter_visible(viewer: Viewer, name: str, *, owner_tenant_id: str | None,
                    base_model: str, base_private: bool) -> bool:
    """A tenant uses its own and the public adapters (`owner_tenant_id` None). One with a
    model list needs the adapter's or its base model's name in it; one without sees public
    adapters of public base models and every adapter it owns."""
    if owner_tenant_id not in (None, viewer.tenant_id):
        return False
    if viewer.models is not None:
        return name in viewer.models or base_model in viewer.models
    return owner_tenant_id is not None or not base_private
