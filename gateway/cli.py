"""The `lockgate` command line."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Annotated

import typer

import lockgate

# click's plain help, not rich's tables: rich shortens option names to fit 80 columns
# (`--max-num-batche…`); click wraps the help text instead and keeps every name whole
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Lockgate: a multi-tenant LLM gateway and engine.")

# Command groups that live outside the runtime package (the benchmarks, beside them in
# loadtests/), each an entry point of this group naming a Typer app. A group whose module or
# dependencies are not installed becomes a command that says what to install.
COMMAND_GROUPS = "lockgate.commands"
INSTALL_HINTS = {
    "bench": "the benchmarks run from a source checkout with the bench extra: "
             "pip install -e '.[bench]'",
}
LORA_DEMO_HINT = ("writing a demo adapter needs peft, the lora-demo extra: pip install 'lockgate[lora-demo]' "
                  "(from a source checkout: pip install -e '.[lora-demo]')")


def _add_unavailable(root: typer.Typer, name: str, hint: str) -> None:
    def unavailable() -> None:
        typer.echo(f"lockgate {name}: {hint}", err=True)
        raise typer.Exit(1)

    root.command(name, help=f"Not installed here: {hint}.",
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(unavailable)


def _add_command_groups(root: typer.Typer) -> None:
    """Each `lockgate.commands` entry point as a sub-command group of `root`."""
    from importlib.metadata import entry_points

    found: set[str] = set()
    for ep in entry_points(group=COMMAND_GROUPS):
        if ep.name in found:
            continue
        found.add(ep.name)
        try:
            group = ep.load()
        except ImportError as exc:
            hint = INSTALL_HINTS.get(ep.name, "its package is not installed")
            _add_unavailable(root, ep.name, f"{hint} ({exc})")
        else:
            root.add_typer(group, name=ep.name)
    for name, hint in INSTALL_HINTS.items():
        if name not in found:
            _add_unavailable(root, name, hint)


_add_command_groups(app)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"lockgate {lockgate.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("demo-model")
def demo_model(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model into")],
    family: Annotated[str, typer.Option(help="llama, qwen2 or mistral")] = "llama",
    size: Annotated[str, typer.Option(help="tiny (tests), tiny-mqa (one KV head), or small (benchmarks)")] = "tiny",
    seed: Annotated[int, typer.Option(help="weights and nothing else depend on it")] = 0,
    copy: Annotated[bool, typer.Option("--copy", help="a llama that quotes its prompt (speculative "
                                       "decoding demos); --size picks its vocabulary: tiny or small")] = False,
    draft: Annotated[bool, typer.Option("--draft", help="the copy model's smaller draft (implies --copy)")] = False,
) -> None:
    """Write a small random-weight Hugging Face model with a tokenizer, offline."""
    from lockgate.engine import write_copy_model, write_demo_model

    if (copy or draft) and family != "llama":
        raise typer.BadParameter("--copy and --draft write a llama; leave --family out", param_hint="--family")
    try:
        if copy or draft:
            path = write_copy_model(out_dir, draft=draft, size=size, seed=seed)
        else:
            path = write_demo_model(out_dir, family=family, size=size, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    kind = "copy draft" if draft else "copy" if copy else "demo"
    typer.echo(f"wrote {family}/{size} {kind} model (seed {seed}) to {path}")


@app.command("demo-adapter")
def demo_adapter(
    base_dir: Annotated[Path, typer.Argument(help="Hugging Face base model directory (e.g. from demo-model)")],
    out_dir: Annotated[Path, typer.Argument(help="directory to write the PEFT adapter into")],
    rank: Annotated[int, typer.Option(help="LoRA rank r, >= 1")] = 8,
    targets: Annotated[str, typer.Option(help="modules, comma-separated: q,k,v,o,gate,up,down")] = "q,v",
    seed: Annotated[int, typer.Option(help="adapter weights and nothing else depend on it")] = 0,
) -> None:
    """Write a random-weight PEFT LoRA adapter for a base model, offline."""
    import importlib.util

    from lockgate.engine import parse_targets, write_demo_adapter

    if importlib.util.find_spec("peft") is None:
        typer.echo(f"lockgate demo-adapter: {LORA_DEMO_HINT}", err=True)
        raise typer.Exit(1)
    try:
        modules = parse_targets(targets)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("targets: "), param_hint="--targets") from exc
    if rank < 1:
        raise typer.BadParameter(f"must be >= 1, got {rank}", param_hint="--rank")
    try:
        path = write_demo_adapter(base_dir, out_dir, rank=rank, targets=modules, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except OSError as exc:
        raise typer.BadParameter(f"cannot load a model from {base_dir}: {exc}", param_hint="BASE_DIR") from exc
    typer.echo(f"wrote rank-{rank} LoRA adapter on {','.join(modules)} (seed {seed}) to {path}")


@app.command("quantize")
def quantize(
    model_dir: Annotated[Path, typer.Argument(help="full-precision Hugging Face model directory")],
    out_dir: Annotated[Path, typer.Argument(help="directory to write the quantized checkpoint into")],
    method: Annotated[str, typer.Option(help="awq (AutoAWQ GEMM) or gptq (GPTQ v1)")] = "awq",
    group_size: Annotated[int | None, typer.Option(
        help="input channels per scale and zero point; -1: one group per row (default: gptq 128; "
             "awq the largest of 128, 64, 32 dividing every projection's input size)",
    )] = None,
    bits: Annotated[int, typer.Option(help="4, or 8 (gptq only)")] = 4,
    desc_act: Annotated[bool, typer.Option(
        "--desc-act", help="gptq: group channels by descending column norm",
    )] = False,
    sym: Annotated[bool | None, typer.Option(
        "--sym/--asym", help="gptq: symmetric (default) or not; awq is asymmetric",
    )] = None,
) -> None:
    """Write an AWQ or GPTQ 4/8-bit checkpoint (round-to-nearest), as AutoAWQ / GPTQModel lay it out."""
    from lockgate.engine import QuantizeSpec, default_group_size, quantize_model

    try:
        if group_size is None:
            group_size = default_group_size(model_dir, method.lower())
        spec = QuantizeSpec(method=method.lower(), bits=bits, group_size=group_size, desc_act=desc_act,  # type: ignore[arg-type]
                            sym=(method.lower() == "gptq") if sym is None else sym)
        path = quantize_model(model_dir, out_dir, spec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except OSError as exc:
        raise typer.BadParameter(f"cannot read a model from {model_dir}: {exc}", param_hint="MODEL_DIR") from exc
    typer.echo(f"wrote {spec.method} {spec.bits}-bit (group {spec.group_size}) checkpoint to {path}")


db_app = typer.Typer(no_args_is_help=True, help="The tenancy database (Alembic migrations).")
app.add_typer(db_app, name="db")


def _settings(**overrides):
    from pydantic import ValidationError

    from lockgate.gateway.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise typer.BadParameter(f"{field}: {err['msg']}") from None


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="target revision")] = "head",
    database_url: Annotated[str | None, typer.Option(
        help="default: LOCKGATE_DATABASE_URL or the embedded SQLite",
    )] = None,
) -> None:
    """Migrate the database to REVISION (default: head)."""
    from lockgate.tenancy import db

    settings = _settings(database_url=database_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = settings.resolved_database_url()
    db.upgrade(url, revision)
    current, head = db.schema_status(url)
    typer.echo(f"database at {current} (head {head})")


@db_app.command("status")
def db_status(database_url: Annotated[str | None, typer.Option()] = None) -> None:
    """Print the database's revision and the code's head revision."""
    from lockgate.tenancy import db

    url = _settings(database_url=database_url).resolved_database_url()
    current, head = db.schema_status(url)
    typer.echo(f"current {current or 'none'}, head {head}{'' if current == head else ' (behind)'}")


# vLLM's engine flags, by vLLM's names: its dtype spellings, and the engine keyword each sets
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "float16": "float16",
          "half": "float16", "bfloat16": "bfloat16"}
ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
                "block_size", "enable_prefix_caching", "enable_lora", "dtype", "tensor_parallel_size",
                "pipeline_parallel_size", "speculative_config", "kv_offloading_size")


def engine_flags(**flags: object) -> dict[str, object]:
    """The engine keywords the given vLLM flags set (those left out: the engine's defaults or
    LOCKGATE_ENGINE_KWARGS). `dtype` in vLLM's spellings; `block_size` a power of two."""
    out = {k: v for k, v in flags.items() if v is not None}
    if "dtype" in out:
        dtype = str(out["dtype"]).lower()
        if dtype not in DTYPES:
            raise typer.BadParameter(f"one of {', '.join(DTYPES)}; got {out['dtype']!r}", param_hint="--dtype")
        out["dtype"] = DTYPES[dtype]
    size = out.get("block_size")
    if isinstance(size, int) and size & (size - 1):
        raise typer.BadParameter(f"must be a power of two; got {size}", param_hint="--block-size")
    spec = out.get("speculative_config")
    if isinstance(spec, str):
        out["speculative_config"] = _speculative_config(spec)
    stages = out.get("pipeline_parallel_size")
    if isinstance(stages, int) and stages > 1:
        raise typer.BadParameter(f"pipeline parallelism is not supported; got {stages} (only 1): split a model "
                                 "over devices with --tensor-parallel-size instead",
                                 param_hint="--pipeline-parallel-size")
    return out


def _speculative_config(text: str) -> dict[str, object]:
    """--speculative-config's JSON, checked as the engine will check it."""
    from lockgate.engine import SpeculativeConfig

    try:
        value = json.loads(text)
        SpeculativeConfig.of(value)
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(f"vLLM's JSON, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                 f"\"prompt_lookup_max\": 3}}': {exc}", param_hint="--speculative-config") from None
    return value


def _device_note(flags: dict[str, object], pool: str | None) -> str | None:
    """What to say when a flag cannot act here: gpu-memory-utilization sizes a CUDA device's
    share; on the CPU the KV cache takes `kv_cache_memory` bytes instead."""
    if "gpu_memory_utilization" not in flags or pool:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return ("lockgate: --gpu-memory-utilization applies to CUDA devices; this machine has none, so "
            "it has no effect: on the CPU the KV cache takes kv_cache_memory bytes (512 MiB unless "
            "LOCKGATE_ENGINE_KWARGS='{\"kv_cache_memory\": BYTES}' says otherwise)")


_SPEC_HELP = ("speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
              "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m}, or a draft model sharing the "
              "model's tokenizer: {\"model\": DIR, \"num_speculative_tokens\": k} (default off)")
_OFFLOAD_HELP = ("GiB of host memory for a second KV tier that evicted prefixes go to (default: min(the KV "
                 "cache's size, 1/4 of available host memory, 16 GiB); 0: off)")


_EP_HELP = "the embedded engine in a process of its own, apart from the HTTP server (default off)"


@app.command("serve")
def serve(
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="NAME=DIR or DIR; repeat for several (default: the demo model)")] = None,
    host: Annotated[str | None, typer.Option(help="default 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default 8000")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="default LOCKGATE_DATA_DIR or ~/.local/share/lockgate")] = None,
    migrate: Annotated[bool, typer.Option(
        "--migrate", help="run migrations on LOCKGATE_DATABASE_URL at start")] = False,
    shutdown_timeout: Annotated[float | None, typer.Option(help="seconds in-flight requests get after SIGTERM")] = None,
    private_model: Annotated[list[str] | None, typer.Option(
        "--private-model", help="a model served only to tenants that list it")] = None,
    pool: Annotated[str | None, typer.Option(
        help="join an engine pool on Ray: 'auto' (a local Ray), HOST:PORT or ray://HOST:PORT "
             "(default LOCKGATE_POOL; none: the embedded engine)")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        min=1, help="sequences in one step (default 128 on the CPU, as vLLM's server; else 256)")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        min=2, help="context length (default: the model's)")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        min=1, help="tokens in one step (default 2048)")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        min=0.01, max=1.0, help="CUDA: the device's share to use (default 0.9); "
        "no effect on the CPU (kv_cache_memory sizes the cache there)")] = None,
    block_size: Annotated[int | None, typer.Option(
        min=1, help="tokens per KV block, a power of two (default 16)")] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="default on")] = None,
    enable_lora: Annotated[bool | None, typer.Option(
        "--enable-lora/--no-enable-lora", help="serve LoRA adapters (default on, unlike vLLM)")] = None,
    max_loras: Annotated[int | None, typer.Option(
        min=1, help="adapters in one step (default 4)")] = None,
    max_lora_rank: Annotated[int | None, typer.Option(
        min=1, help="largest adapter rank (default 64)")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="auto, float32 (float), float16 (half) or bfloat16")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option("--tensor-parallel-size", "-tp", min=1, help=(
        "split each model over this many devices, a rank process each (default 1)"))] = None,
    pipeline_parallel_size: Annotated[int | None, typer.Option("--pipeline-parallel-size", "-pp", min=1, help=(
        "only 1 (vLLM's flag, accepted for its scripts)"))] = None,
    speculative_config: Annotated[str | None, typer.Option("--speculative-config", help=_SPEC_HELP)] = None,
    kv_offloading_size: Annotated[float | None, typer.Option(min=0.0, help=_OFFLOAD_HELP)] = None,
    root_path: Annotated[str | None, typer.Option(help="the path prefix a proxy serves it under: /ops")] = None,
    console: Annotated[bool | None, typer.Option("--console/--no-console", help="/console (default on)")] = None,
    engine_process: Annotated[bool | None, typer.Option("--engine-process/--no-engine-process", help=_EP_HELP)] = None,
) -> None:
    """Run the gateway and its engine(s) (no configuration: SQLite, the in-process limiter, the demo
    model under the data directory). The engine flags are vLLM's; they win over LOCKGATE_ENGINE_KWARGS."""
    from lockgate.gateway.server import run_server

    args = locals()       # ENGINE_FLAGS are this command's parameters, by the engine's names
    flags = engine_flags(**{name: args[name] for name in ENGINE_FLAGS})
    settings = _settings(models=model or None, host=host, port=port, data_dir=data_dir, migrate=migrate or None,
                         shutdown_timeout_s=shutdown_timeout, private_models=private_model or None, pool=pool,
                         max_loras=max_loras, max_lora_rank=max_lora_rank, root_path=root_path, console=console,
                         engine_process=engine_process)
    settings.engine_kwargs = {**settings.engine_kwargs, **flags}
    if note := _device_note(flags, settings.pool):
        typer.echo(note, err=True)
    raise typer.Exit(run_server(settings))


keys_app = typer.Typer(no_args_is_help=True, help="API keys, written straight to the database "
                       "(a lost admin key: `lockgate keys create --admin`; a read-only console key: "
                       "`--viewer`).")
app.add_typer(keys_app, name="keys")


@keys_app.command("create")
def keys_create(
    admin: Annotated[bool, typer.Option("--admin", help="an admin key")] = False,
    viewer: Annotated[bool, typer.Option(
        "--viewer", help="a viewer admin key: reads the admin API and the console, changes nothing")] = False,
    tenant: Annotated[str | None, typer.Option(help="a tenant's inference key: the tenant's id")] = None,
    name: Annotated[str, typer.Option(help="the key's name")] = "cli",
    data_dir: Annotated[Path | None, typer.Option(help="default LOCKGATE_DATA_DIR or ~/.local/share/lockgate")] = None,
    database_url: Annotated[str | None, typer.Option(
        help="default: LOCKGATE_DATABASE_URL or the embedded SQLite",
    )] = None,
) -> None:
    """Create a key in the server's database (its pepper: LOCKGATE_PEPPER or the data
    directory's) and print it, bare, on stdout. Works while the server runs."""
    if admin + viewer + (tenant is not None) != 1:
        raise typer.BadParameter("give exactly one of --admin, --viewer and --tenant TENANT_ID")
    scope = "admin" if admin else "viewer" if viewer else "inference"
    settings = _settings(data_dir=data_dir, database_url=database_url)
    try:
        plaintext = asyncio.run(_create_key(settings, tenant_id=tenant, name=name, scope=scope))
    except (ValueError, LookupError) as exc:
        typer.echo(f"lockgate keys create: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(plaintext)


async def _create_key(settings, *, tenant_id: str | None, name: str, scope: str) -> str:
    """The key, created by actor "cli" in one audited transaction."""
    from lockgate.tenancy import api_keys, db, keys
    from lockgate.tenancy.errors import TenancyError

    url = settings.resolved_database_url()
    if settings.embedded:
        settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        await db.upgrade_async(url)
    else:
        current, head = await asyncio.to_thread(db.schema_status, url)
        if current != head:
            raise ValueError(f"the database schema is at {current or 'nothing'}, the code needs "
                             f"{head}: run `lockgate db upgrade`")
    pepper = (keys.pepper_from_setting(settings.pepper.get_secret_value()) if settings.pepper
              else keys.load_or_create_pepper(settings.data_dir))
    engine = db.make_engine(url)
    try:
        async with db.make_sessionmaker(engine)() as session:
            _, plaintext = await api_keys.create_key(
                session, tenant_id=tenant_id, name=name, pepper=pepper, actor="cli",
                scopes=(scope,))
    except TenancyError as exc:
        raise ValueError(str(exc)) from None
    finally:
        await engine.dispose()
    return plaintext


if __name__ == "__main__":
    app()
