"""The FastAPI application: start-up (database, models, limiter, keys), middleware, routes.

    app = create_app(Settings())          # what `lockgate serve` runs under uvicorn
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from lockgate.engine import AsyncEngine, ModelBinding, WorkerPoolStats, server_engine_defaults
from lockgate.gateway import admin, batch_api, messages_api, metrics_api, openai_api, responses_api, tokenize_api
from lockgate.gateway.admin import vllm_lora
from lockgate.gateway.authenticator import Authenticator
from lockgate.gateway.background import Background
from lockgate.gateway.batch_runner import BatchRunner
from lockgate.gateway.console import install as install_console
from lockgate.gateway.console.web import SecurityHeaders
from lockgate.gateway.draining import DrainGate
from lockgate.gateway.errors import install_error_handlers
from lockgate.gateway.fields import refuse_nul_params
from lockgate.gateway.http_limits import BodyLimits
from lockgate.gateway.memory import trim_loop
from lockgate.gateway.metrics import CountResponses, Metrics
from lockgate.gateway.model_catalog import read_catalog
from lockgate.gateway.model_directory import ModelDirectory, ModelEntry
from lockgate.gateway.openapi import install_openapi
from lockgate.gateway.reconciler import reconcile_once, replay_charger
from lockgate.gateway.request_context import RequestContext
from lockgate.gateway.root_path import RootPath
from lockgate.gateway.settings import Settings, parse_model_specs
from lockgate.gateway.state import AppState, Lifecycle
from lockgate.gateway.tokenize_pool import TokenizePool
from lockgate.tenancy import api_keys, db, keys, tenants
from lockgate.tenancy.limiter import FailoverLimiter, InProcessLimiter, Limiter, RedisLimiter
from lockgate.tenancy.limiter.rebuild import BudgetRebuilder
from lockgate.tenancy.usage.refusals import RefusalCounter
from lockgate.tenancy.usage.writer import UsageWriter

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"
EngineFactory = Callable[..., Any]     # (model_dir, **engine_kwargs) -> an engine


class SchemaBehind(RuntimeError):
    """The configured database is not at the migrations' head."""


def show_secret(settings: Settings, name: str, label: str, secret: str,
                hint: Callable[[str], str] | None = None) -> None:
    """Shown once: on the terminal (outside logging); or, when stdout is not one, the bare
    secret alone in a 0600 file `name` in the data directory (so `$(cat FILE)` is the key),
    and only the file's name in the log. `hint(key)`: a line to print after it, given the
    key, or `$(cat FILE)` in its place."""
    if sys.stdout.isatty():
        print(f"lockgate: {label} (shown once): {secret}", flush=True)
        if hint is not None:
            print(hint(secret), flush=True)
        return
    path = settings.data_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    print(f"lockgate: {name.replace('_', ' ')} written to {path} (mode 0600)", flush=True)
    if hint is not None:
        print(hint(f"$(cat {path})"), flush=True)


async def prepare_database(settings: Settings) -> str:
    url = settings.resolved_database_url()
    if settings.embedded or settings.migrate:
        await db.upgrade_async(url)
        return url
    current, head = await asyncio.to_thread(db.schema_status, url)
    if current != head:
        raise SchemaBehind(
            f"the database schema is at {current or 'nothing'}, the code needs {head}: "
            "run `lockgate db upgrade` or pass --migrate"
        )
    return url


def embedded_engine_kwargs(s: Settings) -> dict[str, Any]:
    """An embedded engine's keywords: a server's defaults (`server_engine_defaults`: on the
    CPU, 128 sequences a step as vLLM's server), then LoRA's and the settings' own."""
    return {**server_engine_defaults(str(s.engine_kwargs.get("device", "auto"))), **s.lora_engine_kwargs()}


async def load_models(s: Settings, engine_factory: EngineFactory) -> dict[str, ModelEntry]:
    """Start the engines of the configured models (the demo model when none is given)."""
    specs = parse_model_specs(s.models)
    if not specs:
        from lockgate.engine import write_demo_model

        path = s.data_dir / "models" / DEMO_MODEL
        if not (path / "config.json").is_file():
            print(f"lockgate: building the demo model in {path} (first start only)", flush=True)
            await asyncio.to_thread(write_demo_model, path, family="llama", size="small", seed=0)
        specs = {DEMO_MODEL: path}
    private = set(s.private_models)
    unknown = private - set(specs)
    if unknown:
        raise ValueError(f"private_models: {sorted(unknown)} are not served models")
    engines: dict[str, ModelBinding]
    if s.pool:
        # workers on Ray, each serving every model under its budget; placement and routing
        # decide which worker runs which request
        from lockgate.engine import Pool, PoolConfig

        pool = Pool(PoolConfig(address=s.pool, models={n: str(p) for n, p in specs.items()},
                               engine_kwargs={**({"memory_budget": s.memory_budget} if s.memory_budget else {}),
                                              **s.lora_engine_kwargs()},
                               namespace=s.pool_namespace, workers=s.pool_workers,
                               threads=s.pool_threads, call_timeout_s=s.pool_call_timeout_s,
                               owner_ttl_s=s.lease_ttl_s))
        await pool.start()
        engines = {name: pool.for_model(name) for name in specs}
    elif s.shared_engine and len(specs) > 1:
        # one engine, one memory budget: the models take turns on the device by demand
        (first, first_path), *rest = specs.items()
        pool = engine_factory(str(first_path), served_model_name=first,
                                    models={n: str(p) for n, p in rest}, memory_budget=s.memory_budget,
                                    **embedded_engine_kwargs(s))
        await pool.start()
        engines = {name: pool.for_model(name) for name in specs}
    else:
        engines = {}
        for name, path in specs.items():
            # the gateway's name for the model is the engine's (requests name it)
            engine = engine_factory(str(path), **{**embedded_engine_kwargs(s), "served_model_name": name})
            await engine.start()
            engines[name] = ModelBinding(engine, name)
    # tokenizers, chat templates (their renderers loaded now, not on the first request) and
    # context lengths, from the model directories: the gateway's own, not the engine's
    infos = await read_catalog(specs, max_model_len=s.lora_engine_kwargs().get("max_model_len"))
    return {name: ModelEntry(name, Path(path), engines[name], infos[name], private=name in private)
            for name, path in specs.items()}


async def bootstrap_keys(state: AppState) -> None:
    """The first admin key (or the configured one), the embedded demo tenant, and every
    tenant's fairness weight pushed to the engines."""
    s = state.settings
    async with state.sessions() as session:
        if s.admin_key is not None:
            await api_keys.ensure_admin_key(session, s.admin_key.get_secret_value(), state.pepper)
        elif not await api_keys.has_admin_key(session):
            _, plaintext = await api_keys.create_key(session, tenant_id=None, name="bootstrap",
                                                    scopes=("admin",), pepper=state.pepper,
                                                    actor="bootstrap")
            show_secret(s, "admin_key", "admin key", plaintext)
        else:
            print("lockgate: this database has admin keys; none is shown again. Lost yours? "
                  "Set LOCKGATE_ADMIN_KEY=lg-... (32+ characters after lg-) and restart: it is added "
                  "as an admin key; or run `lockgate keys create --admin` with this server's "
                  "LOCKGATE_DATA_DIR and LOCKGATE_DATABASE_URL", flush=True)
        if s.embedded and s.create_demo_tenant:
            existing = [t for t in await tenants.list_tenants(session, limit=1000) if t.name == "demo"]
            if not existing:
                t = await tenants.create_tenant(session, name="demo", actor="bootstrap")
                _, plaintext = await api_keys.create_key(session, tenant_id=t.id, name="demo",
                                                        pepper=state.pepper, actor="bootstrap")
                model = next(iter(state.models))

                def curl(key: str) -> str:
                    return (f"lockgate: try it:\n  curl http://{s.host}:{s.port}{s.root_path}/v1/chat/completions "
                            f"-H \"Authorization: Bearer {key}\" -H 'Content-Type: application/json' "
                            f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
                            f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'")

                show_secret(s, "demo_key", "demo tenant key", plaintext, curl)
        after = None
        while True:
            page = await tenants.list_tenants(session, limit=500, after=after)
            for t in page:
                state.models.push_weight(t.id, t.weight)
            if len(page) < 500:
                break
            after = page[-1].id


async def heartbeat(state: AppState) -> None:
    """Every `lease_ttl_s` / 3: renew this replica's leases."""
    interval = max(0.5, state.settings.lease_ttl_s / 3)
    while True:
        await asyncio.sleep(interval)
        if state.inflight:
            try:
                await state.limiter.heartbeat(list(state.inflight.values()))
            except Exception:  # any failure, logged: the next beat tries again; leases outlive one miss
                logger.warning("lease heartbeat failed", exc_info=True)


async def reconciler(state: AppState) -> None:
    """On the heartbeat's period, in a task of its own (a slow pass never delays a
    heartbeat): settle the admissions of requests that died with another replica."""
    interval = max(0.5, state.settings.lease_ttl_s / 3)
    while True:
        await asyncio.sleep(interval)
        try:
            await reconcile_once(state)
        except Exception:  # any failure, logged: the next pass tries again
            logger.warning("lease reconciler failed", exc_info=True)


def load_pepper(s: Settings) -> bytes:
    """The key-hashing pepper: the configured one, else this data directory's own."""
    if s.pepper is None and not s.embedded:
        logger.warning("LOCKGATE_PEPPER is not set: API keys are hashed under this data "
                       "directory's pepper, so replicas with other data directories will not "
                       "accept them; set the same LOCKGATE_PEPPER on every replica")
    return (keys.pepper_from_setting(s.pepper.get_secret_value()) if s.pepper
            else keys.load_or_create_pepper(s.data_dir))


def make_limiter(s: Settings, sessions: Any = None) -> Limiter:
    """In-process without Redis; on Redis, bounded by `redis_timeout_s` and, while Redis fails,
    closed (503) or open (this replica's in-process limiter) as `limits_on_redis_failure` says;
    budgets Redis lost are rebuilt from the usage rows of `sessions` (`limiter.rebuild`)."""
    if not s.redis_url:
        return InProcessLimiter(lease_ttl=s.lease_ttl_s)
    rebuilder = BudgetRebuilder(sessions, s.database_timeout_s) if sessions is not None else None
    shared = RedisLimiter(s.redis_url, prefix=s.redis_prefix, lease_ttl=s.lease_ttl_s,
                          timeout=s.redis_timeout_s, rebuilder=rebuilder)
    fallback = InProcessLimiter(lease_ttl=s.lease_ttl_s) if s.limits_on_redis_failure == "open" else None
    return FailoverLimiter(shared, fallback=fallback, max_queued=s.limiter_max_queued_settlements)


def database_engine(s: Settings, url: str) -> Any:
    """The database engine; on PostgreSQL each connect and statement is bounded by
    `database_timeout_s`, and so is the wait for a pooled connection."""
    if not url.startswith("postgresql"):
        return db.make_engine(url)
    t = s.database_timeout_s
    return db.make_engine(url, pool_timeout=t, connect_args={"timeout": t, "command_timeout": t})


def build_state(s: Settings, entries: dict[str, ModelEntry], database: Any, sessions: Any, limiter: Limiter,
                usage: UsageWriter, pepper: bytes, lifecycle: Lifecycle) -> AppState:
    """The services, built at once from the parts `lifespan` started."""
    background = Background()
    models = ModelDirectory(entries, sessions, s.resolved_adapter_root(), s.adapter_cache_ttl_s)
    return AppState(
        settings=s, models=models, db=database, sessions=sessions, limiter=limiter, usage=usage,
        auth=Authenticator(sessions, pepper, s.key_cache_ttl_s, background), lifecycle=lifecycle,
        background=background, metrics=Metrics(models.engine_stats),
        # its worker processes start on the first large prompt, never at start-up
        tokenize=TokenizePool(workers=s.tokenizer_workers, inline_chars=s.tokenizer_inline_chars),
        refusals=RefusalCounter(sessions, interval_s=s.refusal_flush_interval_s, timeout_s=s.database_timeout_s,
                                max_buckets=s.refusal_max_buckets))


async def start_serving(state: AppState) -> tuple[BatchRunner, list[asyncio.Task[None]]]:
    """What a built state starts before the first request: metrics of the pool and the
    limiter, the bootstrap keys, the refusal counts' flushes and the background loops."""
    pooled = [m for m in state.models.values() if m.engine.stats().workers is not None]
    if pooled:
        engine = pooled[0].engine     # one pool serves every model: its workers once
        state.metrics.watch_pool(lambda: dataclasses.asdict(engine.stats().workers or WorkerPoolStats()))
    limiter = state.limiter
    if isinstance(limiter, FailoverLimiter):
        state.metrics.watch_limiter(lambda: limiter.counts)
    await bootstrap_keys(state)
    s = state.settings
    if s.console:
        print(f"lockgate: the admin console: http://{s.host}:{s.port}{s.root_path}/console/ "
              "(sign in with an admin key)", flush=True)
    state.refusals.start()     # 429 counts to the database every refusal_flush_interval_s
    loop = asyncio.get_running_loop()
    runner = BatchRunner(state)
    tasks = [loop.create_task(heartbeat(state)), loop.create_task(reconciler(state)),
             loop.create_task(state.models.adapters.watch()), loop.create_task(runner.run())]
    if s.memory_trim_interval_s > 0:
        tasks.append(loop.create_task(trim_loop(s.memory_trim_interval_s, s.memory_trim_growth_mb << 20)))
    return runner, tasks


async def stop_serving(state: AppState | None, runner: BatchRunner | None, tasks: list[asyncio.Task[None]],
                       lifecycle: Lifecycle, grace_s: float) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        # each loop's database call unwinds (its connection closed on the driver's thread)
        # before the database is disposed; a connection left to close later waits on a thread
        # that is gone, and a loop closing then never finishes
        await asyncio.wait(tasks, timeout=grace_s)
    if runner is not None:
        await runner.stop()      # batch lines in flight abandoned, the batches handed back
    if state is not None:
        await state.background.wait()
        await state.tokenize.close()
    # runs still open (a shutdown without the server's drain) are cut and write their rows
    # before the writer closes
    await lifecycle.drain(0, grace_s)
    if state is not None:
        await state.refusals.close()     # the last 429 counts, within database_timeout_s


def usage_writer(s: Settings, sessions: Any, limiter: Limiter) -> UsageWriter:
    # rows the database cannot take (down, or no answer within database_timeout_s) are
    # spooled under the data directory and replayed once it is back, charged to the budgets
    # then if their reservations were refunded meanwhile (`reconciler.replay_charger`)
    return UsageWriter(sessions, max_batch=s.usage_batch_max, max_delay_s=s.usage_batch_delay_s,
                       synchronous_commit=s.usage_synchronous_commit, spool_dir=s.data_dir / "usage-spool",
                       timeout_s=s.database_timeout_s, replay_interval_s=s.usage_replay_interval_s,
                       on_replayed=replay_charger(limiter))


@asynccontextmanager
async def lifespan(app: FastAPI, settings: Settings, engine_factory: EngineFactory) -> AsyncIterator[None]:
    """Build the parts (database, pepper, limiter, usage writer, models), then the `AppState`
    from them at once; serve; then stop them in order."""
    s = settings
    lifecycle: Lifecycle = app.state.lifecycle
    s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    s.resolved_adapter_root().mkdir(parents=True, exist_ok=True)
    database = database_engine(s, await prepare_database(s))
    sessions = db.make_sessionmaker(database)
    pepper = load_pepper(s)
    limiter = make_limiter(s, sessions)
    usage = usage_writer(s, sessions, limiter)
    await usage.start()
    entries: dict[str, ModelEntry] = {}
    state: AppState | None = None
    runner: BatchRunner | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        entries = await load_models(s, engine_factory)
        state = build_state(s, entries, database, sessions, limiter, usage, pepper, lifecycle)
        app.state.lockgate = state
        runner, tasks = await start_serving(state)
        # Everything made so far (torch, transformers, the models' tables: hundreds of
        # thousands of objects) lives as long as the server. Frozen, the cyclic GC stops
        # walking it: otherwise each full collection stalls every request and engine step.
        gc.collect()
        gc.freeze()
        lifecycle.ready = True
        yield
    finally:
        gc.unfreeze()     # what this app made may be collected once it stops
        lifecycle.ready = False
        lifecycle.draining = True
        await stop_serving(state, runner, tasks, lifecycle, s.shutdown_grace_s)
        await usage.close()
        await limiter.close()
        for m in entries.values():
            await m.engine.shutdown()
        await database.dispose()


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    # innermost first: the drain's 503 has a request id, and every answer is counted; the root
    # path outermost, so that every layer reads the route's path (`root_path.route_path`)
    max_upload = settings.max_file_bytes + (64 << 10)      # a file and its multipart framing
    if settings.console:
        app.add_middleware(SecurityHeaders)         # the CSP of every answer under /console
    app.add_middleware(DrainGate)
    app.add_middleware(BodyLimits, max_body_bytes=settings.max_body_bytes, max_upload_bytes=max_upload,
                       upload_paths=RequestContext.UPLOAD_PATHS, timeout_s=settings.body_read_timeout_s,
                       min_bytes_per_s=settings.body_min_bytes_per_s)
    app.add_middleware(RequestContext, max_body_bytes=settings.max_body_bytes,
                       max_upload_bytes=max_upload)
    app.add_middleware(CountResponses)
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path)


def create_app(settings: Settings | None = None, engine_factory: EngineFactory = AsyncEngine) -> FastAPI:
    """`engine_factory(model_dir, **engine_kwargs)` makes each model's engine: AsyncEngine, or
    anything with its interface (the gateway benchmark's instant stand-in). The app's
    `AppState` (`app.state.lockgate`) is built at start-up; `app.state.lifecycle` exists from
    here on."""
    settings = settings or Settings()
    app = FastAPI(title="Lockgate", version="0.1.0",
                  lifespan=partial(lifespan, settings=settings, engine_factory=engine_factory),
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  # no NUL in any route's path or query parameters: PostgreSQL refuses them
                  dependencies=[Depends(refuse_nul_params)])
    app.state.lifecycle = Lifecycle()
    install_error_handlers(app)
    # OpenAI's, the admin console, vLLM's adapter routes (admin keys only) and /tokenize,
    # /metrics (an admin key or the metrics token), Anthropic's Messages API
    for api in (openai_api, batch_api, responses_api, admin, vllm_lora, tokenize_api, metrics_api, messages_api):
        app.include_router(api.router)
    if settings.console:        # the admin console's pages (gateway/console/)
        install_console(app)
    install_openapi(app, openai_api.BODY_MODELS + responses_api.BODY_MODELS + tokenize_api.BODY_MODELS
                    + messages_api.BODY_MODELS)

    @app.get("/health", include_in_schema=False)
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", include_in_schema=False)
    async def ready(request: Request) -> JSONResponse:
        state: AppState = request.app.state.lockgate
        checks: dict[str, bool | int | str] = {
            "models": state.ready and all(m.engine.is_ready for m in state.models.values())}
        try:
            async with asyncio.timeout(state.settings.database_timeout_s), state.sessions() as session:
                await db.ping(session)
            checks["database"] = True
        except Exception:  # noqa: BLE001
            checks["database"] = False
        checks["draining"] = state.draining
        # "ok", "degraded" (open: limits per replica while Redis fails) or "unavailable"
        # (closed, Redis not answering): within the limiter's own timeout, at once in an outage
        checks["limiter"] = await state.limiter.check()
        # the database down is "degraded", not "not_ready": usage is spooled, cached keys are
        # served, and every replica shares the database, so none would be better to route to
        checks["usage_spooled"] = state.usage.pending
        degraded = not checks["database"] or state.usage.pending > 0
        ok = (checks["models"] and not state.draining
              and checks["limiter"] != "unavailable")
        status = ("degraded" if degraded else "ready") if ok else "not_ready"
        return JSONResponse({"status": status, **checks},
                            status_code=200 if ok else 503)

    _add_middleware(app, settings)
    return app
