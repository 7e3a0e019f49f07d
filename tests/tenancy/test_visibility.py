"""Which models and adapters a tenant may use, worked through the cases of `tenancy.visibility`."""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.tenancy.visibility import adapter_visible, model_visible


@dataclass
class Viewer:
    tenant_id: str | None
    models: tuple[str, ...] | None = None


def test_models_without_a_list_are_the_public_ones():
    v = Viewer("t1")
    assert model_visible(v, "base", private=False)
    assert not model_visible(v, "secret", private=True)


def test_a_model_list_names_exactly_what_is_visible():
    v = Viewer("t1", models=("secret",))
    assert model_visible(v, "secret", private=True)
    assert not model_visible(v, "base", private=False)


def test_adapters_own_and_public_never_another_tenants():
    v = Viewer("t1")
    assert adapter_visible(v, "mine", owner_tenant_id="t1", base_model="base", base_private=False)
    assert adapter_visible(v, "pub", owner_tenant_id=None, base_model="base", base_private=False)
    assert not adapter_visible(v, "theirs", owner_tenant_id="t2", base_model="base", base_private=False)


def test_public_adapters_of_a_private_base_need_a_model_list():
    """Without a list: a public adapter on a private base is hidden, one's own is not."""
    v = Viewer("t1")
    assert not adapter_visible(v, "pub", owner_tenant_id=None, base_model="secret", base_private=True)
    assert adapter_visible(v, "mine", owner_tenant_id="t1", base_model="secret", base_private=True)
    listed = Viewer("t1", models=("secret",))
    assert adapter_visible(listed, "pub", owner_tenant_id=None, base_model="secret", base_private=True)


def test_a_model_list_admits_an_adapter_by_its_name_or_its_base():
    v = Viewer("t1", models=("a1",))
    assert adapter_visible(v, "a1", owner_tenant_id=None, base_model="base", base_private=False)
    assert not adapter_visible(v, "a2", owner_tenant_id=None, base_model="base", base_private=False)
    assert not adapter_visible(v, "a1", owner_tenant_id="t2", base_model="base", base_private=False)
