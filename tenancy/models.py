"""The tenancy tables (SQLAlchemy 2.0 declarative, portable across SQLite and PostgreSQL).

`migrations/versions` must create exactly this schema; `tests/test_migrations.py` checks it."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

SERVICE_TIERS = ("default", "priority", "flex")
# A new tenant's plan when its creator names none: `priority` (which preempts everyone
# else's work in the engine) is granted by an admin, on create or by PATCH. Existing rows
# keep the tiers they were stored with.
DEFAULT_PLAN = ("default", "flex")
SCOPES = ("inference", "admin", "viewer")
# the scopes of a key without a tenant: "admin" may do anything on the admin side, "viewer"
# read it only (gateway/caller.py's `may` is the one rule)
ADMIN_SCOPES = ("admin", "viewer")
TENANT_STATUSES = ("active", "suspended")
USAGE_STATUSES = ("ok", "error", "cancelled")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_tenant_id() -> str:
    return "ten_" + secrets.token_hex(8)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def new_adapter_id() -> str:
    return "ada_" + secrets.token_hex(8)


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that always stores UTC and always returns aware UTC values,
    also on SQLite (which keeps no zone). Naive input is taken to be UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # raw SQLite text, e.g. from a textual query
            value = datetime.fromisoformat(value)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class _QuotaColumns:
    """The five quota limits (names as `tenancy.quota.Quota`'s fields); NULL is unlimited."""

    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_concurrent_requests: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    daily_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Tenant(_QuotaColumns, Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("weight > 0", name="weight_positive"),
        CheckConstraint("status IN ('active', 'suspended')", name="status"),
        CheckConstraint("cached_input_price >= 0 AND cached_input_price <= 1", name="cached_input_price"),
    )

    id: Mapped[str] = mapped_column(String(20), primary_key=True, default=new_tenant_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="active")
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    service_tiers: Mapped[list[str]] = mapped_column(JSON, default=lambda: list(DEFAULT_PLAN))
    default_tier: Mapped[str] = mapped_column(String(16), default="default")
    # None (SQL NULL): every public model; else the model/adapter names this tenant may use.
    models: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # the fraction of a prompt token the day and month budgets count for one read from the
    # engine's prefix cache (tokens per minute count every token)
    cached_input_price: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    # None (SQL NULL): the server's aliases only; else model name or pattern -> served model
    model_aliases: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # speculative decoding for this tenant's requests (false: they decode without draft tokens)
    speculative: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r}, status={self.status!r})"


class ApiKey(_QuotaColumns, Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(20), primary_key=True, default=new_key_id)
    # NULL for admin keys, which belong to no tenant.
    tenant_id: Mapped[str | None] = mapped_column(
        String(20), ForeignKey("tenants.id"), nullable=True, index=True
    )
    name: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(12), unique=True, index=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    def __repr__(self) -> str:
        return f"ApiKey(id={self.id!r}, tenant_id={self.tenant_id!r}, name={self.name!r})"


class Adapter(Base):
    """A LoRA adapter an operator registered: served on top of `base_model` under `name`,
    to its owner tenant only, or to every tenant when `owner_tenant_id` is NULL."""

    __tablename__ = "adapters"

    id: Mapped[str] = mapped_column(String(20), primary_key=True, default=new_adapter_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    base_model: Mapped[str] = mapped_column(String(128))
    owner_tenant_id: Mapped[str | None] = mapped_column(
        String(20), ForeignKey("tenants.id"), nullable=True, index=True
    )
    path: Mapped[str] = mapped_column(String(1024))          # relative to the adapter root
    rank: Mapped[int] = mapped_column(Integer)
    targets: Mapped[list[str]] = mapped_column(JSON)         # module names, e.g. ["q_proj"]
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    def __repr__(self) -> str:
        return f"Adapter(id={self.id!r}, name={self.name!r}, base_model={self.base_model!r})"


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        CheckConstraint("status IN ('ok', 'error', 'cancelled')", name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    # Indexed by the leading column of ix_usage_records_tenant_id_created_at.
    tenant_id: Mapped[str] = mapped_column(String(20), ForeignKey("tenants.id"))
    api_key_id: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(String(128))
    service_tier: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    # what the day and month budgets were charged (`quota.budget_tokens`); NULL on rows written
    # before cached tokens were priced, whose charge was prompt + completion
    budget_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    queue_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # the client's own x-request-id (not unique: a client may reuse one), for reconciliation
    client_request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # the batch whose line this request was (the Batch API), else null
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)


class AuditEntry(Base):
    __tablename__ = "audit_entries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    actor: Mapped[str] = mapped_column(String(64))           # a key id, or "bootstrap"
    action: Mapped[str] = mapped_column(String(64))          # e.g. "tenant.create"
    target_type: Mapped[str] = mapped_column(String(32))     # "tenant" | "key"
    target_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class ConsoleSession(Base):
    """A signed-in admin console: the browser holds a random token, the row its SHA-256 (a
    leaked table signs no one in), the admin key it was exchanged for (read on every request,
    so revoking the key ends its sessions on every replica) and when it expires."""

    __tablename__ = "console_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(20), ForeignKey("api_keys.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


# -- the Batch API: files, batches and their lines ----------------------------------------------------
FILE_PURPOSES = ("batch", "batch_output")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
BATCH_LINE_STATUSES = ("pending", "done", "error")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def escape_nul(value: str) -> str:
    """A string as a PostgreSQL text column can hold it (no NUL): backslashes doubled, NUL as
    backslash-0, so that `unescape_nul` gives the string back exactly."""
    return value.replace("\\", "\\\\").replace("\x00", "\\0")


def unescape_nul(value: str) -> str:
    out, i = [], 0
    while (j := value.find("\\", i)) >= 0:
        out.append(value[i:j])
        out.append("\x00" if value[j + 1:j + 2] == "0" else value[j + 1:j + 2])
        i = j + 2
    out.append(value[i:])
    return "".join(out)


class NulSafeString(TypeDecorator[str]):
    """Free text a client wrote (a batch line's custom_id), NUL characters included, stored
    escaped (`escape_nul`): PostgreSQL's text cannot hold NUL, and the client must get its
    text back exactly."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return escape_nul(value) if value is not None else None

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        return unescape_nul(value) if value is not None else None


class StoredFile(Base):
    """A file of the Files API: its bytes in the database, so that every replica reads it, in
    `FileChunk` rows of at most `FILE_CHUNK_BYTES` each (written and read a chunk at a time,
    so that no file is ever whole in memory). `content` holds only the bytes of a file
    stored before the chunks existed (None since)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=new_file_id)
    tenant_id: Mapped[str] = mapped_column(String(20), ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(256))
    size: Mapped[int] = mapped_column("bytes", BigInteger)
    content: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)


FILE_CHUNK_BYTES = 1 << 20


class FileChunk(Base):
    """`seq`-th piece of a file's bytes (binary: any byte, NUL included); gone with its file."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(String(40), ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """A batch: its lines run in the offline class; one replica at a time works it (the lease)."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=new_batch_id)
    tenant_id: Mapped[str] = mapped_column(String(20), ForeignKey("tenants.id"))
    api_key_id: Mapped[str] = mapped_column(String(20))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    output_expires_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    paused: Mapped[str | None] = mapped_column(String(256), nullable=True)   # why, while it waits
    lease_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class BatchLine(Base):
    """One line of a batch's input, and once it ran, its answer (or its error): `done` and
    `error` are final, written in the same transaction as the line's usage row."""

    __tablename__ = "batch_lines"
    __table_args__ = (Index("ix_batch_lines_batch_id_status", "batch_id", "status"),)

    batch_id: Mapped[str] = mapped_column(String(40), ForeignKey("batches.id", ondelete="CASCADE"),
                                          primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str | None] = mapped_column(NulSafeString(1024), nullable=True)
    body: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class RefusalCount(Base):
    """Requests a limit refused (429s), per tenant, key, limit, service tier and UTC minute: added to by
    each replica's `RefusalCounter` flush (an upsert adding its deltas), read by the quota
    report. No foreign key: a flush must never fail on a row, and rows outlive their key."""

    __tablename__ = "refusal_counts"
    __table_args__ = (Index("ix_refusal_counts_minute", "minute"),)

    tenant_id: Mapped[str] = mapped_column(String(20), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(20), primary_key=True)
    scope: Mapped[str] = mapped_column(String(8), primary_key=True)     # whose limit: "tenant" | "key"
    reason: Mapped[str] = mapped_column(String(32), primary_key=True)   # a Quota field name
    # the tier the request asked for; its tenant's default tier when refused before its body was read
    service_tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)   # UTC, seconds 0
    count: Mapped[int] = mapped_column(BigInteger)


# -- the Responses API: stored responses ---------------------------------------------------------------
def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class StoredResponse(Base):
    """A Responses API answer its request asked to keep (`store`, the default): the request's
    input items and the Response object, for `GET /v1/responses/{id}` and for a later
    `previous_response_id`; its tenant's alone, in the database so that every replica finds
    it, until `expires_at` (the retention), when a sweep deletes it."""

    __tablename__ = "stored_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=new_response_id)
    tenant_id: Mapped[str] = mapped_column(String(20), ForeignKey("tenants.id"), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
