"""Gateway settings: `LOCKGATE_*` environment variables, an optional config file, CLI flags.

With nothing set, Lockgate runs embedded: SQLite and the demo model under `data_dir`, the
in-process limiter. `LOCKGATE_DATABASE_URL` and `LOCKGATE_REDIS_URL` switch to PostgreSQL
and Redis, shared by every gateway replica.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lockgate"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOCKGATE_", extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None          # None: SQLite in data_dir, migrated at start
    # None: the in-process limiter. redis:// or rediss:// (one node), redis+cluster://H:P[,H:P...]
    # (Redis Cluster), redis+sentinel://H:P[,H:P...]/SERVICE[/DB] (Sentinel's master): see
    # tenancy/limiter/redis_conn.py
    redis_url: str | None = None
    redis_prefix: str = "lockgate:"          # key prefix in Redis (replicas must agree)
    redis_timeout_s: float = 0.25            # the most any wait on Redis takes (connect, each reply)
    # while Redis fails: "closed" refuses new requests (503 limiter_unavailable), "open" admits
    # them through this replica's in-process limiter (each replica enforces each quota alone)
    limits_on_redis_failure: Literal["closed", "open"] = "closed"
    limiter_max_queued_settlements: int = 10_000   # settlements kept for Redis's return (oldest dropped)
    admin_key: SecretStr | None = None       # the bootstrap admin key; generated when absent
    pepper: SecretStr | None = None          # HMAC pepper for API keys; generated in data_dir when absent
    models: list[str] = Field(default_factory=list)   # "NAME=DIR" or "DIR"; empty: the demo model
    private_models: list[str] = Field(default_factory=list)  # served only to tenants listing them
    # model name or fnmatch pattern -> served model, for the Messages API's `claude-*` ids (a
    # tenant's own `model_aliases` come first); LOCKGATE_MODEL_ALIASES='{"claude-*": "demo"}'
    model_aliases: dict[str, str] = Field(default_factory=dict)
    # an engine pool on Ray (engine/pool/): "auto" starts a local Ray, "HOST:PORT" or
    # "ray://HOST:PORT" joins a cluster; None: the embedded engine, no Ray
    pool: str | None = None
    pool_namespace: str = "lockgate"         # replicas of one gateway share the pool's named actors
    pool_workers: int | None = Field(default=None, ge=1)   # None: one per device the cluster lends
    pool_threads: int = Field(default=1, ge=1)              # CPU threads of each worker
    pool_call_timeout_s: float = Field(default=30.0, gt=0)  # every Ray call but a stream's next output
    host: str = "127.0.0.1"
    port: int = 8000
    migrate: bool = False                    # with database_url: run migrations at start
    create_demo_tenant: bool = True          # embedded default only: a "demo" tenant and key
    # /metrics names tenants: it takes an admin key, or this token (a scraper's own, as a
    # bearer token); metrics_public opens it to anyone who reaches the port (a private network)
    metrics_token: SecretStr | None = None
    metrics_public: bool = False
    # the admin console at /console (gateway/console/): signed in with an admin key
    console: bool = True
    console_session_ttl_s: float = Field(default=8 * 3600.0, gt=0, le=30 * 86400)
    console_sign_ins_per_minute: int = Field(default=10, ge=1)    # per client address, per replica
    # the path prefix a proxy serves Lockgate under ("/ops"): URLs the app writes start with it,
    # and requests arrive with it or with it stripped
    root_path: str = ""

    # request limits
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_tokens_limit: int | None = None      # None: the model's context decides
    max_prompt_chars: int = 1 << 20
    max_stop_sequences: int = 4
    # structured outputs (gateway/structured.py): a schema's size, and how long compiling it may take
    max_schema_bytes: int = Field(default=64 << 10, ge=64)
    grammar_compile_timeout_s: float = Field(default=5.0, gt=0)
    # prompts of this many characters or more are tokenized by worker processes, off the event
    # loop (gateway/tokenize_pool.py); each worker holds a few hundred MB
    tokenizer_workers: int = Field(default=1, ge=1, le=64)
    tokenizer_inline_chars: int = Field(default=8_192, ge=0)
    # before authentication (gateway/http_limits.py): a request's headers, their count, and the
    # time they may take to arrive (from the connection's or the request's first byte)
    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    header_timeout_s: float = Field(default=10.0, gt=0)
    # a request's whole body must arrive within body_read_timeout_s of the app's first read of
    # it, plus a second per body_min_bytes_per_s bytes received (a large upload at a fair rate
    # still fits; a client dripping bytes does not): else 408 and closed (gateway/http_limits.py),
    # so a slow client cannot hold its tenant's concurrency for request_timeout_s
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    body_min_bytes_per_s: int = Field(default=256 << 10, ge=0)

    # a tenant whose plan sets no max_concurrent_requests gets this many (None, in a config file:
    # unlimited), so a burst meets its own 429s before it can keep a replica's event loop busy
    default_max_concurrent_requests: int | None = Field(default=64, ge=1)
    # admissions under way on one replica (arrived, no lease yet); past it 503 server_busy with
    # Retry-After, before any limiter call (gateway/serving/local_admissions.py)
    max_admissions_in_flight: int = Field(default=256, ge=1)

    # behaviour
    key_cache_ttl_s: float = 2.0             # a revoked key stops working within 2x this (+ a lookup)
    shutdown_timeout_s: float = 30.0
    usage_batch_max: int = 256
    usage_batch_delay_s: float = 0.0         # 0: classic group commit (no waiting for more)
    usage_synchronous_commit: bool = True    # False: PostgreSQL acknowledges before the WAL flush
    # a concurrency lease lives this long after its last heartbeat (one every lease_ttl_s / 3):
    # a dead replica's slots come back, and its reservations are reconciled, within about this
    lease_ttl_s: float = 10.0
    request_timeout_s: float = 600.0         # every admitted request ends within this (cancelled)
    shutdown_grace_s: float = 5.0            # after shutdown_timeout_s: cut requests write their rows
    database_timeout_s: float = 5.0          # a route's database work; usage writes, each
    usage_replay_interval_s: float = 2.0     # spooled usage rows: how often the database is retried
    # 429s are counted in memory per tenant, key, limit and minute, and added to the database
    # this often (and at shutdown); at most this many counters are held while it is down
    refusal_flush_interval_s: float = 5.0
    refusal_max_buckets: int = 100_000
    default_tier: str = "default"
    # after a flood, freed heap pages go back to the system (gateway/memory.py): the resident
    # size is looked at this often (0: never) and trimmed once it grew by this much
    memory_trim_interval_s: float = Field(default=5.0, ge=0)
    memory_trim_growth_mb: int = Field(default=64, ge=1)
    # a flex request is refused (429 resource_unavailable) while the engine's queued work takes
    # longer than this to compute (its cost model): background work waits behind no more than
    # this, and is refused before the engine's own bound (memory) refuses anything
    flex_max_queue_s: float = Field(default=30.0, gt=0)

    # engine
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)   # wins over the LoRA fields below
    # several models: one engine on one memory budget (engine.ModelPool), switching by demand;
    # False: an engine per model
    shared_engine: bool = True
    # `lockgate serve`'s embedded engine in a process of its own (engine.ProcessEngine), out of
    # reach of the HTTP loop's GIL; off by default: on the 2-core machine it measured 0.86-1.00x
    # of the engine in process at 16 concurrent (docs/benchmarks.md, bench serve --peer vllm)
    engine_process: bool = False
    memory_budget: int | None = None   # bytes for all models of the shared engine (None: all fit)

    # the Batch API (gateway/batch_api.py, gateway/batch_runner.py)
    max_file_bytes: int = Field(default=64 << 20, ge=1024)     # an uploaded file (POST /v1/files)
    # uploads at once on a replica, and of one tenant on a replica (past either: 429 before the
    # body is read): each holds a spooled temporary file and a database transaction
    max_uploads_in_flight: int = Field(default=8, ge=1)
    max_tenant_uploads_in_flight: int = Field(default=2, ge=1)
    batch_max_lines: int = Field(default=50_000, ge=1)         # requests in one batch's input file
    batch_poll_s: float = Field(default=1.0, gt=0)             # how often a replica looks for batches
    batch_lease_ttl_s: float = Field(default=30.0, gt=0)       # a dead replica's batches move after this
    batch_max_active: int = Field(default=8, ge=1)             # batches one replica works at once
    batch_max_inflight: int = Field(default=16, ge=1)          # a replica's batch lines in the engine at once
    batch_pause_poll_s: float = Field(default=5.0, gt=0)       # a batch paused by a limit retries this often
    file_sweep_interval_s: float = Field(default=60.0, gt=0)   # expired files and responses deleted this often

    # the Responses API (gateway/responses_api.py): a stored response (and its input items) is
    # kept this long, then answers 404 and is deleted by the sweep above (default 30 days)
    responses_retention_s: float = Field(default=30 * 86400.0, gt=0)

    # LoRA adapters
    adapter_root: Path | None = None         # None: data_dir / "adapters"; every adapter lives under it
    max_loras: int = 4                       # adapters in one step (device slots)
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None         # parsed adapters kept in host memory; None: max_loras
    adapter_cache_ttl_s: float = 5.0         # a deleted adapter stops working on every replica within this

    @model_validator(mode="after")
    def _batch_lease(self) -> Settings:
        if self.batch_poll_s * 3 > self.batch_lease_ttl_s:
            raise ValueError(f"batch_poll_s ({self.batch_poll_s:g}) must be at most a third of "
                             f"batch_lease_ttl_s ({self.batch_lease_ttl_s:g}): leases are renewed "
                             "from the poll loop")
        return self

    @model_validator(mode="after")
    def _adapter_root(self) -> Settings:
        if self.adapter_root is None:
            self.adapter_root = self.data_dir / "adapters"
        return self

    def resolved_adapter_root(self) -> Path:
        """The directory every adapter lives under (`data_dir / "adapters"` unless set)."""
        return self.adapter_root if self.adapter_root is not None else self.data_dir / "adapters"

    def lora_engine_kwargs(self) -> dict[str, Any]:
        """What each model's engine is built with: LoRA on, these limits, then engine_kwargs.
        LoRA stays off where the engine cannot split adapters yet (tensor parallelism), unless
        engine_kwargs turn it on (the engine's refusal then says why)."""
        return {"enable_lora": True, "max_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank, "max_cpu_loras": self.max_cpu_loras, **self.engine_kwargs}

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v < 65536:
            raise ValueError("must be in [0, 65535]")
        return v

    @field_validator("request_timeout_s", "shutdown_grace_s", "database_timeout_s",
                     "usage_replay_interval_s", "refusal_flush_interval_s")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if not 0 < v <= 86400:
            raise ValueError("must be a number of seconds over 0, at most 86400")
        return v

    @field_validator("max_body_bytes", "max_n", "max_prompt_chars", "max_loras", "max_lora_rank",
                     "limiter_max_queued_settlements", "refusal_max_buckets")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("metrics_token")
    @classmethod
    def _metrics_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (it guards tenant names)")
        return v

    @field_validator("root_path")
    @classmethod
    def _root_path(cls, v: str) -> str:
        if v and (not v.startswith("/") or v.endswith("/") or "//" in v or any(c in v for c in "?#% ")):
            raise ValueError("must be empty or a path such as /ops: starting with /, not ending with /")
        return v

    @field_validator("redis_timeout_s")
    @classmethod
    def _positive_seconds(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be > 0 seconds")
        return v

    @property
    def embedded(self) -> bool:
        return self.database_url is None

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'lockgate.db'}"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("LOCKGATE_CONFIG")
        if config_file:
            path = Path(config_file)
            if path.suffix in (".toml",):
                from pydantic_settings import TomlConfigSettingsSource

                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                from pydantic_settings import JsonConfigSettingsSource

                sources.append(JsonConfigSettingsSource(settings_cls, json_file=path))
        return tuple(sources)


def parse_model_specs(specs: list[str]) -> dict[str, Path]:
    """`NAME=DIR` or `DIR` (named after the directory) -> {name: dir}; names are unique."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            path, name = spec, Path(spec).name
        name = name.strip()
        if not name:
            raise ValueError(f"model: {spec!r} has an empty name")
        if name in out:
            raise ValueError(f"model: the name {name!r} is given twice")
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ValueError(f"model: {str(p)!r} is not a directory")
        out[name] = p
    return out
