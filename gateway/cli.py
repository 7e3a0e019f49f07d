"""The `lockgate` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Lockgate: a multi-tenant LLM gateway and engine.")

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

    from rich.markup import escape

    root.command(name, help=escape(f"Not installed here: {hint}."),
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


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("demo-model")
def demo_model(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model into")],
    family: Annotated[str, typer.Option(help="llama, qwen2 or mistral")] = "llama",
    size: Annotated[str, typer.Option(help="tiny (tests) or small (benchmarks)")] = "tiny",
    seed: Annotated[int, typer.Option(help="weights and nothing else depend on it")] = 0,
) -> None:
    """Write a small random-weight Hugging Face model with a tokenizer, offline."""
    from engine import write_demo_model

    try:
        path = write_demo_model(out_dir, family=family, size=size, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {family}/{size} demo model (seed {seed}) to {path}")


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

    from engine import parse_targets, write_demo_adapter

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
    group_size: Annotated[int, typer.Option(help="input channels per scale and zero point; -1: one group")] = 128,
    bits: Annotated[int, typer.Option(help="4, or 8 (gptq only)")] = 4,
    desc_act: Annotated[bool, typer.Option(
        "--desc-act", help="gptq: group channels by descending column norm",
    )] = False,
    sym: Annotated[bool | None, typer.Option(
        "--sym/--asym", help="gptq: symmetric (default) or not; awq is asymmetric",
    )] = None,
) -> None:
    """Write an AWQ or GPTQ 4/8-bit checkpoint (round-to-nearest), as AutoAWQ / GPTQModel lay it out."""
    from engine import QuantizeSpec, quantize_model

    try:
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

    from gateway.settings import Settings

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
    from tenancy import db

    settings = _settings(database_url=database_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = settings.resolved_database_url()
    db.upgrade(url, revision)
    current, head = db.schema_status(url)
    typer.echo(f"database at {current} (head {head})")


@db_app.command("status")
def db_status(database_url: Annotated[str | None, typer.Option()] = None) -> None:
    """Print the database's revision and the code's head revision."""
    from tenancy import db

    url = _settings(database_url=database_url).resolved_database_url()
    current, head = db.schema_status(url)
    typer.echo(f"current {current or 'none'}, head {head}{'' if current == head else ' (behind)'}")


@app.command("serve")
def serve(
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="NAME=DIR or DIR; repeat for several (default: the demo model)",
    )] = None,
    host: Annotated[str | None, typer.Option(help="default 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default 8000")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="default LOCKGATE_DATA_DIR or ~/.local/share/lockgate")] = None,
    migrate: Annotated[bool, typer.Option(
        "--migrate", help="run migrations on LOCKGATE_DATABASE_URL at start",
    )] = False,
    shutdown_timeout: Annotated[float | None, typer.Option(help="seconds in-flight requests get after SIGTERM")] = None,
    private_model: Annotated[list[str] | None, typer.Option(
        "--private-model", help="a model served only to tenants that list it",
    )] = None,
    pool: Annotated[str | None, typer.Option(
        help="join an engine pool on Ray: 'auto' (a local Ray), HOST:PORT or ray://HOST:PORT "
             "(default LOCKGATE_POOL; none: the embedded engine)",
    )] = None,
) -> None:
    """Run the gateway and its engine(s). With no configuration: SQLite, the in-process
    limiter and the demo model under the data directory."""
    from gateway.server import run_server

    settings = _settings(models=model or None, host=host, port=port, data_dir=data_dir,
                         migrate=migrate or None, shutdown_timeout_s=shutdown_timeout,
                         private_models=private_model or None, pool=pool)
    raise typer.Exit(run_server(settings))


if __name__ == "__main__":
    app()
