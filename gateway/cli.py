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
