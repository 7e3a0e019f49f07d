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
