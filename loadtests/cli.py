"""`lockgate bench ...`: the benchmark commands (Typer), found by `lockgate` through the
`lockgate.commands` entry point. Importing this module raises ImportError, naming what is
missing, when the `bench` extra is not installed, so `lockgate bench` can say so."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer

# what the benchmarks import beyond the runtime (the `bench` extra)
BENCH_REQUIRES = ("aiohttp", "httpx", "psutil", "peft")
_missing = [m for m in BENCH_REQUIRES if importlib.util.find_spec(m) is None]
if _missing:
    raise ModuleNotFoundError(f"missing {', '.join(_missing)}",
                              name=_missing[0])

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios against a baseline.")


@bench_app.command("throughput")
def bench_throughput(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    num_requests: Annotated[int, typer.Option(min=1)] = 128,
    seed: Annotated[int, typer.Option()] = 0,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    block_size: Annotated[int, typer.Option(min=1)] = 16,
    skip_hf: Annotated[bool, typer.Option(help="skip the HF static-batching side")] = False,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side; the fastest counts")] = 3,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
    peer: Annotated[str | None, typer.Option(
        help="measure against a peer engine instead: 'vllm' (its CPU build, in the venv "
             "scripts/peer-vllm.sh makes); 64 requests unless --num-requests is given")] = None,
    scaling: Annotated[bool, typer.Option(
        help="with --peer: also 16/64/256 concurrent sequences and a 7B-shaped layer")] = False,
    neighbour: Annotated[int, typer.Option(
        min=0, help="with --peer: both sides beside this many processes burning a core each, "
                    "and the engine alone too")] = 0,
    baseline: Annotated[str | None, typer.Option(
        help="also run the engine of this git revision (e.g. main~3), alternating with this one")] = None,
    skip_ideal: Annotated[bool, typer.Option(help="skip the ideal-batching side")] = False,
) -> None:
    """Offline throughput: the engine vs HF static batching vs the ideal-batching bound, or
    (--peer vllm) the engine vs vLLM's CPU build, both checked against HF."""
    if peer is not None:
        from lockgate.loadtests.bench_peer import PeerUnavailable, bench_peer

        try:
            bench_peer(str(model) if model else None, peer=peer,
                       num_requests=64 if num_requests == 128 else num_requests, seed=seed,
                       repeats=repeats, scaling=scaling, json_out=str(json_out) if json_out else None,
                       neighbour=neighbour, echo=typer.echo)
        except PeerUnavailable as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        return
    from lockgate.loadtests.bench_throughput import bench_throughput as run

    run(
        str(model) if model else None,
        num_requests=num_requests,
        seed=seed,
        engine_kwargs={"max_num_batched_tokens": max_num_batched_tokens,
                       "max_num_seqs": max_num_seqs, "block_size": block_size},
        skip_hf=skip_hf,
        repeats=repeats,
        json_out=str(json_out) if json_out else None,
        baseline=baseline,
        skip_ideal=skip_ideal,
        echo=typer.echo,
    )


@bench_app.command("kernels")
def bench_kernels(
    kernel: Annotated[list[str] | None, typer.Option(
        help="paged_attention, lora or quant (repeatable; default all)")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="activation dtype (default bfloat16 on CUDA, float32 on the CPU)")] = None,
    quick: Annotated[bool | None, typer.Option(
        help="small shapes (default on the CPU, where Triton is interpreted)")] = None,
    iters: Annotated[int, typer.Option(min=1, help="timed calls per side; the median counts")] = 20,
) -> None:
    """Each Triton kernel against its baseline: time, ratio, GB/s, FLOP/s, share of the
    device's peaks (measured here: a large copy, a large matmul)."""
    from lockgate.loadtests.bench_kernels import KERNELS
    from lockgate.loadtests.bench_kernels import bench_kernels as run

    chosen = tuple(kernel or KERNELS)
    unknown = [k for k in chosen if k not in KERNELS]
    if unknown:
        typer.echo(f"error: --kernel: unknown {', '.join(unknown)} (known: {', '.join(KERNELS)})", err=True)
        raise typer.Exit(2)
    try:
        run(kernels=chosen, dtype_name=dtype, quick=quick, iters=iters, echo=typer.echo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@bench_app.command("gateway")
def bench_gateway(
    database_url: Annotated[str, typer.Option(
        help="PostgreSQL to make a scratch database lockgate_bench_<pid> in (dropped afterwards)",
    )] = "postgresql://postgres@127.0.0.1:5432/test",
    redis_url: Annotated[str, typer.Option(
        help="Redis for the limiter (a unique key prefix, deleted afterwards)",
    )] = "redis://127.0.0.1:6379/0",
    rates: Annotated[str, typer.Option(
        help="request rates to step through, req/s, comma-separated",
    )] = "100,200,300,400,500,600",
    duration: Annotated[float, typer.Option(min=0.5, help="seconds per rate")] = 5.0,
    clients: Annotated[int, typer.Option(min=1, help="load-generator processes (each sends rate/N)")] = 1,
    repeats: Annotated[int, typer.Option(
        min=1, help="attempts per rate; the best (fewest errors, lowest p99) counts",
    )] = 1,
    model: Annotated[Path | None, typer.Option(
        help="model directory for the tokenizer (default: the tiny llama demo model)",
    )] = None,
    ref_rate: Annotated[float, typer.Option(help="the rate the added-latency targets are judged at")] = 300.0,
    floor: Annotated[bool, typer.Option(help="also time a bare uvicorn app at the reference rate")] = True,
    warmup: Annotated[float, typer.Option(min=0.0, help="seconds of unreported warm-up load")] = 2.0,
    max_time: Annotated[float, typer.Option(
        min=1.0, help="skip rate steps that would end past this many seconds",
    )] = 300.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
    synchronous_commit: Annotated[bool, typer.Option(
        "--synchronous-commit/--async-commit", help="usage rows: wait for the WAL flush (production default) or not",
    )] = True,
) -> None:
    """The gateway's added latency under open-loop load, vs its engine called directly.

    One uvicorn worker on PostgreSQL and Redis, with an engine that answers at once."""
    from lockgate.loadtests.bench_gateway import bench_gateway as run
    from lockgate.loadtests.harness.services import ServiceUnavailable

    try:
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise typer.BadParameter(f"--rates: expected numbers separated by commas, got {rates!r}") from None
    if not rate_list or any(r <= 0 for r in rate_list):
        raise typer.BadParameter("--rates: give one or more positive rates")
    try:
        run(database_url=database_url, redis_url=redis_url, rates=rate_list, duration=duration,
            model_dir=str(model) if model else None, clients=clients, repeats=repeats,
            ref_rate=ref_rate, floor=floor, warmup_s=warmup, max_time_s=max_time,
            json_out=str(json_out) if json_out else None, echo=typer.echo,
            synchronous_commit=synchronous_commit)
    except ServiceUnavailable as exc:
        typer.echo(f"lockgate bench gateway: {exc}", err=True)
        raise typer.Exit(2) from None


def _dump(path: Path | None, out: dict) -> None:
    if path is not None:
        import json

        path.write_text(json.dumps(out, indent=2, default=str))


def _check_ranges(*ranges: tuple[str, tuple[int, int]]) -> None:
    """Each (option, (MIN, MAX)) a range of lengths: 1 <= MIN <= MAX, else BadParameter."""
    for name, (lo, hi) in ranges:
        if not 1 <= lo <= hi:
            raise typer.BadParameter(f"{name}: expected 1 <= MIN <= MAX, got {lo} {hi}")


def _bench_tiers(model: Path | None, duration: float, seed: int, num_threads: int,
                 json_out: Path | None) -> None:
    """`bench priority --tiers`: its window 20 s unless --duration is given."""
    from lockgate.loadtests.bench_tiers import TierSizes, bench_tiers

    out = bench_tiers(str(model) if model else None, sizes=TierSizes(
        duration_s=duration if duration != 40.0 else 20.0, seed=seed,
        num_threads=num_threads or None), echo=typer.echo)
    _dump(json_out, out)


def _bench_priority_http(duration: float, seed: int, json_out: Path | None) -> None:
    """`bench priority --http`: its window 30 s unless --duration is given."""
    from lockgate.loadtests.bench_priority_http import HttpSizes, bench_priority_http

    out = bench_priority_http(sizes=HttpSizes(duration_s=duration if duration != 40.0 else 30.0,
                                              seed=seed), echo=typer.echo)
    _dump(json_out, out)


@bench_app.command("priority")
def bench_priority(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    duration: Annotated[float, typer.Option(min=1.0, help="seconds of the measured window of each run")] = 40.0,
    warmup: Annotated[float, typer.Option(min=0.0, help="seconds the flood runs alone before the window")] = 15.0,
    drain: Annotated[float, typer.Option(
        min=0.0, help="at most this many seconds after the window for online requests still out",
    )] = 30.0,
    online_rate: Annotated[float, typer.Option(min=0.01, help="online Poisson arrivals per second")] = 1.0,
    online_prompt: Annotated[tuple[int, int], typer.Option(help="online prompt length range MIN MAX")] = (56, 72),
    online_output: Annotated[tuple[int, int], typer.Option(
        help="online output length range MIN MAX (forced)",
    )] = (32, 64),
    offline_outstanding: Annotated[int, typer.Option(min=1, help="offline requests kept outstanding")] = 64,
    offline_prompt: Annotated[tuple[int, int], typer.Option(help="offline prompt length range MIN MAX")] = (512, 1024),
    offline_output: Annotated[int, typer.Option(min=1, help="offline output length (forced)")] = 256,
    num_kv_blocks: Annotated[int, typer.Option(
        min=0, help="KV blocks (0: the engine's default); sized so about half the flood fits",
    )] = 2304,
    online_kv_reserve: Annotated[float, typer.Option(
        min=0.0, max=0.99, help="reserved_kv_fraction of class online",
    )] = 0.1,
    offline_prefill_budget: Annotated[int, typer.Option(
        min=0, help="prefill_token_budget of class offline, tokens per step (0: none)",
    )] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    repeats: Annotated[int, typer.Option(
        min=1, help="runs of each of the four sides, alternating, each in a fresh process; each "
                    "side's best TTFT p99 and best offline tokens/s count",
    )] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
    defaults: Annotated[bool, typer.Option(
        "--defaults", help="every scheduling knob at the engine's default: no online reserve, "
                           "no offline prefill budget, default step targets",
    )] = False,
    tiers: Annotated[bool, typer.Option(
        "--tiers", help="instead: priority requests arriving while online ones fill every sequence slot",
    )] = False,
    http: Annotated[bool, typer.Option(
        "--http", help="instead: through a lockgate serve it starts on defaults, flex clients flooding, "
                       "default clients streaming",
    )] = False,
) -> None:
    """Online trickle beside an offline flood: alone, fcfs, priority.

    Four runs: online alone, offline alone, mixed under fcfs, mixed under priority. Prints
    online TTFT/TPOT, offline tokens/s, step times, the ratios and the step-cost model's
    prediction error. `--tiers` and `--http` run the other two benchmarks of the scheduling
    promise instead (see loadtests/bench_tiers.py, loadtests/bench_priority_http.py)."""
    from lockgate.loadtests.bench_priority import PrioritySizes
    from lockgate.loadtests.bench_priority import bench_priority as run

    if tiers and http:
        raise typer.BadParameter("--tiers and --http: pick one")
    if tiers:
        _bench_tiers(model, duration, seed, num_threads, json_out)
        return
    if http:
        _bench_priority_http(duration, seed, json_out)
        return
    if defaults:
        online_kv_reserve, offline_prefill_budget = 0.0, 0
    _check_ranges(("--online-prompt", online_prompt), ("--online-output", online_output),
                  ("--offline-prompt", offline_prompt))
    sizes = PrioritySizes(
        duration_s=duration, warmup_s=warmup, drain_s=drain, online_rate=online_rate,
        online_prompt=tuple(online_prompt), online_output=tuple(online_output),
        offline_outstanding=offline_outstanding, offline_prompt=tuple(offline_prompt),
        offline_output=offline_output, num_kv_blocks=num_kv_blocks or None,
        online_kv_reserve=online_kv_reserve, offline_prefill_budget=offline_prefill_budget or None,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, num_threads=num_threads or None, seed=seed,
    )
    run(str(model) if model else None, sizes=sizes, json_out=str(json_out) if json_out else None,
        echo=typer.echo, repeats=repeats)


@bench_app.command("fairness")
def bench_fairness(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    num_steps: Annotated[int, typer.Option(min=2, help="engine steps of each run")] = 1500,
    window_steps: Annotated[int, typer.Option(min=1, help="steps per Jain's-index window")] = 50,
    light_outstanding: Annotated[int, typer.Option(min=1, help="requests the light tenant keeps outstanding")] = 16,
    heavy_ratio: Annotated[int, typer.Option(min=1, help="the heavy tenant keeps this many times more")] = 4,
    prompt: Annotated[tuple[int, int], typer.Option(help="prompt length range MIN MAX")] = (32, 256),
    output: Annotated[tuple[int, int], typer.Option(help="output length range MIN MAX (forced)")] = (32, 128),
    heavy_weight: Annotated[float, typer.Option(min=0.001, help="the heavy tenant's fairness weight")] = 1.0,
    light_weight: Annotated[float, typer.Option(min=0.001, help="the light tenant's fairness weight")] = 1.0,
    num_kv_blocks: Annotated[int, typer.Option(
        min=1, help="KV blocks: M of the VTC bound is blocks x block size",
    )] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Two tenants, one with 4x the load: VTC service gap and Jain's index.

    Prints the weighted-service gap against the VTC bound and Jain's index over windows of
    steps while both tenants are backlogged, under priority and under fcfs."""
    from lockgate.loadtests.bench_fairness import FairnessSizes
    from lockgate.loadtests.bench_fairness import bench_fairness as run

    _check_ranges(("--prompt", prompt), ("--output", output))
    sizes = FairnessSizes(
        num_steps=num_steps, window_steps=window_steps, light_outstanding=light_outstanding,
        heavy_ratio=heavy_ratio, prompt=tuple(prompt), output=tuple(output),
        heavy_weight=heavy_weight, light_weight=light_weight, num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        num_threads=num_threads or None, seed=seed,
    )
    run(str(model) if model else None, sizes=sizes, json_out=str(json_out) if json_out else None,
        echo=typer.echo)


@bench_app.command("prefix")
def bench_prefix(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    num_requests: Annotated[int, typer.Option(min=2, help="requests, the first run alone")] = 32,
    prefix_len: Annotated[int, typer.Option(min=1, help="tokens of the shared system prompt")] = 1024,
    suffix: Annotated[tuple[int, int], typer.Option(help="own suffix length range MIN MAX")] = (16, 32),
    output_len: Annotated[int, typer.Option(min=1, help="output tokens per request (forced)")] = 8,
    sequential: Annotated[bool, typer.Option(
        "--sequential/--together", help="send the rest one after another instead of together",
    )] = False,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Requests sharing a long system prompt: prefix caching on vs off.

    Prints TTFT p50 and the prefill tokens computed, caching on and off."""
    from lockgate.loadtests.bench_prefix import PrefixSizes
    from lockgate.loadtests.bench_prefix import bench_prefix as run

    _check_ranges(("--suffix", suffix))
    sizes = PrefixSizes(
        num_requests=num_requests, prefix_len=prefix_len, suffix=tuple(suffix), output_len=output_len,
        sequential=sequential, max_num_batched_tokens=max_num_batched_tokens,
        num_threads=num_threads or None, seed=seed,
    )
    try:
        run(str(model) if model else None, sizes=sizes, json_out=str(json_out) if json_out else None,
            echo=typer.echo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("lora")
def bench_lora(
    model: Annotated[Path | None, typer.Option(
        help="base model directory (default: the small llama demo model)",
    )] = None,
    num_requests: Annotated[int, typer.Option(min=1)] = 64,
    num_adapters: Annotated[int, typer.Option(min=1, help="distinct adapters mixed in the batch (max_loras)")] = 8,
    rank: Annotated[int, typer.Option(min=1)] = 16,
    targets: Annotated[str, typer.Option(help="projections the adapters adapt")] = "q,k,v,o,gate,up,down",
    output_len: Annotated[int, typer.Option(min=1, help="output tokens per request (forced)")] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side, alternating; the best counts")] = 2,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Output tokens/s with many LoRA adapters mixed in the batch vs the base model alone."""
    from lockgate.engine.lora_demo import parse_targets
    from lockgate.loadtests.bench_lora import LoraSizes
    from lockgate.loadtests.bench_lora import bench_lora as run

    try:
        parse_targets(targets)
        sizes = LoraSizes(num_requests=num_requests, num_adapters=num_adapters, rank=rank, targets=targets,
                          output_len=output_len, repeats=repeats, num_threads=num_threads or None, seed=seed)
        run(str(model) if model else None, sizes=sizes, json_out=str(json_out) if json_out else None,
            echo=typer.echo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("switch")
def bench_switch(
    model: Annotated[list[Path] | None, typer.Option(
        help="two model directories (default: two small demo models)",
    )] = None,
    num_online: Annotated[int, typer.Option(min=1, help="online requests for the cold model")] = 8,
    online_gap_s: Annotated[float, typer.Option(min=0.0, help="seconds between them")] = 1.0,
    offline_flood: Annotated[int, typer.Option(
        min=1, help="offline requests kept outstanding on the other model",
    )] = 64,
    mix_outstanding: Annotated[int, typer.Option(
        min=1, help="offline requests kept outstanding per model in the mix",
    )] = 32,
    mix_duration: Annotated[float, typer.Option(min=0.5, help="seconds of the mix (each model alone: half)")] = 8.0,
    output_len: Annotated[int, typer.Option(min=1)] = 32,
    switch_overhead: Annotated[float, typer.Option(
        min=0.001, max=0.999, help="the pool's target share of time spent switching",
    )] = 0.1,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Two base models on a budget that holds one: cold start, cold-model TTFT, switching's share."""
    from lockgate.loadtests.bench_switch import SwitchSizes
    from lockgate.loadtests.bench_switch import bench_switch as run

    if model and len(model) != 2:
        raise typer.BadParameter("give --model twice (two model directories), or not at all")
    sizes = SwitchSizes(num_online=num_online, online_gap_s=online_gap_s, offline_flood=offline_flood,
                        mix_outstanding=mix_outstanding, mix_duration_s=mix_duration, output_len=output_len,
                        switch_overhead=switch_overhead,
                        num_threads=num_threads or None, seed=seed)
    try:
        run((str(model[0]), str(model[1])) if model else None, sizes=sizes,
            json_out=str(json_out) if json_out else None, echo=typer.echo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("chaos")
def bench_chaos(
    num_requests: Annotated[int, typer.Option(min=1)] = 1000,
    kills: Annotated[int, typer.Option(min=0, help="replica kills (SIGKILL, then a restart)")] = 3,
    redis_hang: Annotated[float, typer.Option(min=0.0, help="seconds Redis is stopped (SIGSTOP), once")] = 5.0,
    db_stop: Annotated[float, typer.Option(min=0.0, help="seconds PostgreSQL is down, once")] = 5.0,
    redis_restarts: Annotated[int, typer.Option(min=0, help="Redis killed and started again empty")] = 1,
    overlap: Annotated[float, typer.Option(
        min=0.0, help="seconds of database down, Redis hung and a replica killed together, once")] = 6.0,
    duration: Annotated[float, typer.Option(min=1.0, help="seconds the requests are paced over")] = 120.0,
    concurrency: Annotated[int, typer.Option(min=1, help="client requests in flight, at most")] = 16,
    lease_ttl: Annotated[float, typer.Option(min=0.5, help="the replicas' LOCKGATE_LEASE_TTL_S")] = 6.0,
    seed: Annotated[int, typer.Option()] = 0,
    work_dir: Annotated[Path | None, typer.Option(help="keep the replicas' data and logs here")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Two replicas on a PostgreSQL and a Redis of their own, killed, hung, stopped and restarted
    under load (chat, Responses and Messages, a third each), alone and together: usage rows
    lost / invented / duplicated, over the run and per route, lease release, budgets, time to
    recover."""
    from lockgate.loadtests.chaos import ChaosConfig
    from lockgate.loadtests.chaos import bench_chaos as run
    from lockgate.loadtests.harness.services import ServiceUnavailable

    cfg = ChaosConfig(num_requests=num_requests, kills=kills, redis_hang_s=redis_hang, db_stop_s=db_stop,
                      redis_restarts=redis_restarts, overlap_s=overlap,
                      duration_s=duration, concurrency=concurrency, lease_ttl_s=lease_ttl, seed=seed)
    try:
        ok = run(cfg, work_dir=work_dir, json_out=json_out, echo=typer.echo)
    except ServiceUnavailable as exc:
        typer.echo(f"lockgate bench chaos: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if ok else 1)


@bench_app.command("flood")
def bench_flood(
    flood_streams: Annotated[int, typer.Option(min=1, help="flex streams one tenant keeps open")] = 1500,
    bombers: Annotated[int, typer.Option(min=1, help="loops sending grammar bombs")] = 4,
    bomb_interval_s: Annotated[float, typer.Option(min=0.0, help="seconds between one loop's bombs")] = 0.1,
    probes: Annotated[int, typer.Option(min=2, help="the other tenant's chats per side and repeat")] = 40,
    repeats: Annotated[int, typer.Option(min=1, help="fresh server processes per side")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Another tenant's `default` TTFT alone, beside a one-tenant flood of streams, and
    beside grammar bombs, side by side (targets: p99 within 1 s and no 503 beside the flood;
    within 2 x alone beside the bombs)."""
    from lockgate.loadtests.bench_flood import FloodConfig
    from lockgate.loadtests.bench_flood import bench_flood as run
    from lockgate.loadtests.harness.services import ServiceUnavailable

    cfg = FloodConfig(flood_streams=flood_streams, bombers=bombers, bomb_interval_s=bomb_interval_s,
                      probes=probes, repeats=repeats)
    try:
        ok = run(cfg, json_out=json_out, echo=typer.echo)
    except ServiceUnavailable as exc:
        typer.echo(f"lockgate bench flood: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if ok else 1)


@bench_app.command("pool")
def bench_pool(
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side; the best counts")] = 3,
    tenants: Annotated[int, typer.Option(min=1, help="tenants, each with its own shared prompt")] = 16,
    per_tenant: Annotated[int, typer.Option(min=1, help="requests per tenant in the routing runs")] = 16,
    prefix: Annotated[int, typer.Option(min=16, help="tokens of each tenant's shared prompt")] = 512,
    skew: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="share of the routing workload's requests on one tenant's prefix; "
        "0: every tenant alike")] = 0.7,
    routing_only: Annotated[bool, typer.Option(
        "--routing-only", help="only the routing comparison (no two-model or latency runs)")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """The engine pool on a local two-node Ray cluster: prefix-affinity routing vs round-robin
    (prompt tokens computed, TTFT, in-flight balance), two models on one worker vs two, and the
    latency a pooled request adds over an embedded one."""
    from lockgate.loadtests.bench_pool import bench_pool as run

    out = run(repeats=repeats, tenants=tenants, per_tenant=per_tenant, prefix=prefix,
              skew=skew or None, routing_only=routing_only, echo=typer.echo)
    _dump(json_out, out)


@bench_app.command("kv-tier")
def bench_kv_tier(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side, alternating; the best counts")] = 3,
    conversations: Annotated[int, typer.Option(min=1)] = 16,
    turns: Annotated[int, typer.Option(min=1)] = 6,
    history: Annotated[tuple[int, int], typer.Option(help="shared history length range MIN MAX")] = (1024, 1536),
    device_blocks: Annotated[int, typer.Option(min=1, help="the device KV cache's blocks")] = 128,
    offload_gib: Annotated[float, typer.Option(min=0.0, help="the host tier's size (GiB)")] = 0.25,
    nr_requests: Annotated[int, typer.Option(min=1, help="requests of the no-reuse workload")] = 48,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """The host-memory KV tier on vs off, alternating in fresh processes: multi-turn chats whose
    prefixes the device cache evicts (TTFT p50/p99 of the turns the tier served, prompt tokens
    computed), and distinct prompts without reuse (tokens/s: the tier's overhead)."""
    from lockgate.loadtests.bench_kv_tier import KVTierSizes
    from lockgate.loadtests.bench_kv_tier import bench_kv_tier as run

    _check_ranges(("--history", history))
    sizes = KVTierSizes(conversations=conversations, turns=turns, history=tuple(history),
                        device_blocks=device_blocks, offload_gib=offload_gib, nr_requests=nr_requests,
                        num_threads=num_threads or None)
    out = run(str(model) if model else None, sizes=sizes, repeats=repeats, echo=typer.echo)
    _dump(json_out, out)


@bench_app.command("tp")
def bench_tp(
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side, alternating; the best counts")] = 3,
    size: Annotated[int, typer.Option(min=2, help="the tensor-parallel side's ranks")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Tensor parallelism: one rank vs SIZE ranks, side by side, on the small demo model and a
    7B-shaped decoder layer: output tokens/s and the share of each step spent in collectives."""
    from lockgate.loadtests.bench_tp import bench_tp as run

    out = run(sizes=(1, size), repeats=repeats, echo=typer.echo)
    _dump(json_out, out)


@bench_app.command("spec")
def bench_spec(
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side, alternating; the best counts")] = 3,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Speculative decoding (n-gram) off vs on, side by side on the copy demo model: tokens/s and
    acceptance at batch 1 and 32 on copy-heavy and random prompts, and the online TTFT p99
    beside an offline flood."""
    from lockgate.loadtests.bench_spec import bench_spec as run

    out = run(repeats=repeats, echo=typer.echo)
    _dump(json_out, out)


@bench_app.command("serve")
def bench_serve(
    url: Annotated[str | None, typer.Option(help="the server's base URL, any OpenAI-compatible one")] = None,
    peer: Annotated[str | None, typer.Option(help=(
        "instead: 'vllm': lockgate serve --engine-process against --no-engine-process and vllm serve "
        "(if its venv exists), vLLM's workload, alternating"))] = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="with --peer: prompts per run")] = 200,
    repeats: Annotated[int, typer.Option(min=1, help="with --peer: fresh servers per side")] = 2,
    api_key: Annotated[str | None, typer.Option(
        envvar=["OPENAI_API_KEY", "LOCKGATE_KEY"], show_envvar=False,
        help="bearer key (default: $OPENAI_API_KEY or $LOCKGATE_KEY)",
    )] = None,
    model: Annotated[str | None, typer.Option(help="model name (default: the first of GET /v1/models)")] = None,
    rates: Annotated[str, typer.Option(help="request rates to step through, req/s, comma-separated")] = "1,2,4,8",
    duration: Annotated[float, typer.Option(min=0.1, help="seconds of Poisson arrivals per rate")] = 30.0,
    drain: Annotated[float, typer.Option(
        min=0.0, help="then at most this many seconds for requests still out (they count as failures)",
    )] = 30.0,
    tier_mix: Annotated[str, typer.Option(
        help="service_tier weights, e.g. default=0.7,flex=0.3; `none` sends no tier",
    )] = "default",
    prompt_tokens: Annotated[int, typer.Option(min=1, help="prompt length, in words (about tokens)")] = 64,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of each request")] = 64,
    slo_ttft_ms: Annotated[float, typer.Option(min=0.0, help="goodput's TTFT target")] = 500.0,
    slo_tpot_ms: Annotated[float, typer.Option(min=0.0, help="goodput's TPOT target")] = 50.0,
    seed: Annotated[int, typer.Option()] = 0,
    max_requests: Annotated[int | None, typer.Option(min=1, help="at most this many arrivals per rate")] = None,
    max_in_flight: Annotated[int, typer.Option(min=1, help="requests out at once, at most")] = 512,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds per request")] = 60.0,
    out: Annotated[Path | None, typer.Option(
        help="write results.json, requests.csv and the plots (PNG) here",
    )] = None,
    chat: Annotated[bool, typer.Option("--chat/--completions", help="the endpoint")] = True,
) -> None:
    """Throughput-latency curves: Poisson arrivals at each rate; TTFT, TPOT, ITL, e2e
    p50/p90/p99, output tokens/s and goodput under the SLOs, per service tier."""
    from lockgate.loadtests.bench_serve import BenchServeError, ServeConfig, parse_rates, parse_tier_mix
    from lockgate.loadtests.bench_serve import bench_serve as run

    if peer is not None:
        _bench_serve_peer(peer, num_prompts, repeats, out)
        return
    if url is None:
        raise typer.BadParameter("--url: give the server's URL (or --peer vllm)")
    try:
        cfg = ServeConfig(url=url, rates=parse_rates(rates), tier_mix=parse_tier_mix(tier_mix), api_key=api_key,
                          model=model, duration_s=duration, drain_s=drain, prompt_words=prompt_tokens,
                          max_tokens=max_tokens, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, seed=seed,
                          max_requests=max_requests, timeout_s=timeout,
                          endpoint="chat" if chat else "completions", max_in_flight=max_in_flight)
    except BenchServeError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        run(cfg, out, echo=typer.echo)
    except BenchServeError as exc:
        typer.echo(f"lockgate bench serve: {exc}", err=True)
        raise typer.Exit(2) from None


def _bench_serve_peer(peer: str, num_prompts: int, repeats: int, out: Path | None) -> None:
    from lockgate.loadtests.bench_peer import PeerUnavailable, peer_python
    from lockgate.loadtests.bench_serve_peer import PeerServeSizes, bench_serve_peer

    try:
        python: Path | None = peer_python(peer)
    except PeerUnavailable as exc:
        if peer != "vllm":
            raise typer.BadParameter(str(exc)) from None
        typer.echo(f"lockgate bench serve: {exc}; the vLLM side is left out", err=True)
        python = None
    report = bench_serve_peer(sizes=PeerServeSizes(num_prompts=num_prompts, repeats=repeats),
                              peer_python=python, echo=typer.echo)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _dump(out / "results.json", report)


@bench_app.command("structured")
def bench_structured(
    model: Annotated[Path | None, typer.Option(help="model directory (default: the small llama demo model)")] = None,
    num_requests: Annotated[int, typer.Option(min=2)] = 64,
    output_len: Annotated[int, typer.Option(min=1, help="output tokens per request (forced)")] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each side, alternating; the best counts")] = 3,
    num_threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default)")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results here")] = None,
) -> None:
    """Output tokens/s with half the batch held to a JSON schema vs none constrained."""
    from lockgate.loadtests.bench_structured import StructuredSizes
    from lockgate.loadtests.bench_structured import bench_structured as run

    sizes = StructuredSizes(num_requests=num_requests, output_len=output_len, repeats=repeats,
                            num_threads=num_threads or None, seed=seed)
    run(str(model) if model else None, sizes=sizes, json_out=str(json_out) if json_out else None, echo=typer.echo)


@bench_app.command("console")
def bench_console(
    rows: Annotated[int, typer.Option(min=0, help="usage rows inserted before timing")] = 100_000,
    repeats: Annotated[int, typer.Option(min=1, help="times each page is asked (after one warm-up)")] = 30,
    database_url: Annotated[str, typer.Option(
        help="PostgreSQL server: a scratch database is made there and dropped")] = "postgresql://postgres@127.0.0.1:5432/test",
) -> None:
    """Each admin console page's render time p50/p95 and its SQL statements at ROWS usage
    rows, in a table (target: p95 under 300 ms)."""
    from lockgate.loadtests.bench_console import bench_console as run
    from lockgate.loadtests.harness.services import ServiceUnavailable, pg_dsn, pg_execute

    try:
        pg_execute(pg_dsn(database_url), "SELECT 1")
    except ServiceUnavailable as exc:
        raise typer.BadParameter(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        typer.echo(f"lockgate bench console: PostgreSQL at {database_url} is not reachable ({exc!r})", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if run(database_url, rows, repeats, echo=typer.echo) else 1)
