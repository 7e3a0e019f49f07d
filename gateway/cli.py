"""The `lockgate` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Lockgate: a multi-tenant LLM gateway and engine.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios against a baseline.")
app.add_typer(bench_app, name="bench")


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
    from engine.demo_model import write_demo_model

    try:
        path = write_demo_model(out_dir, family=family, size=size, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {family}/{size} demo model (seed {seed}) to {path}")


@bench_app.command("throughput")
def bench_throughput(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    num_requests: Annotated[int, typer.Option(min=1)] = 128,
    seed: Annotated[int, typer.Option()] = 0,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    block_size: Annotated[int, typer.Option(min=1)] = 16,
    skip_hf: Annotated[bool, typer.Option(help="skip the HF static-batching side")] = False,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side; the fastest counts")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Offline throughput: the engine vs HF static batching vs the ideal-batching bound."""
    from loadtests.bench_throughput import bench_throughput as run

    run(
        str(model) if model else None,
        num_requests=num_requests,
        seed=seed,
        engine_kwargs={"max_num_batched_tokens": max_num_batched_tokens,
                       "max_num_seqs": max_num_seqs, "block_size": block_size},
        skip_hf=skip_hf,
        repeats=repeats,
        json_out=str(json_out) if json_out else None,
        echo=typer.echo,
    )


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
    database_url: Annotated[str | None, typer.Option(help="default: LOCKGATE_DATABASE_URL or the embedded SQLite")] = None,
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
    model: Annotated[list[str] | None, typer.Option("--model", help="NAME=DIR or DIR; repeat for several (default: the demo model)")] = None,
    host: Annotated[str | None, typer.Option(help="default 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default 8000")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="default LOCKGATE_DATA_DIR or ~/.local/share/lockgate")] = None,
    migrate: Annotated[bool, typer.Option("--migrate", help="run migrations on LOCKGATE_DATABASE_URL at start")] = False,
    shutdown_timeout: Annotated[float | None, typer.Option(help="seconds in-flight requests get after SIGTERM")] = None,
    private_model: Annotated[list[str] | None, typer.Option("--private-model", help="a model served only to tenants that list it")] = None,
) -> None:
    """Run the gateway and its engine(s). With no configuration: SQLite, the in-process
    limiter and the demo model under the data directory."""
    from gateway.server import run_server

    settings = _settings(models=model or None, host=host, port=port, data_dir=data_dir,
                         migrate=migrate or None, shutdown_timeout_s=shutdown_timeout,
                         private_models=private_model or None)
    raise typer.Exit(run_server(settings))


if __name__ == "__main__":
    app()
