"""`lockgate loadtest`: a bounded multi-tenant load test of a running `lockgate serve`, with
verdicts. It makes its tenants and keys through the admin API (`loadtest_setup`), runs the
locust suite `locust_mix.py` headless in a subprocess for the given time (every request
then runs to its end), and writes into the output folder locust's CSVs and HTML report, the
per-request samples, plots (`loadtest_plots`) and a summary in Markdown and JSON
(`loadtest_summary`). Exit status 0 when the hard verdicts pass (every class served, no
unexpected failures, quota accounting error 0), 1 when one fails, 2 when it could not run.

Found by `lockgate` through the `lockgate.commands` entry point; importing this module raises
ImportError, naming what is missing, when locust, matplotlib or httpx is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import typer

from lockgate.loadtests.loadtest_summary import SloTargets

if TYPE_CHECKING:
    from lockgate.loadtests.loadtest_setup import Tenant

LOADTEST_REQUIRES = ("locust", "matplotlib", "httpx")
_missing = [m for m in LOADTEST_REQUIRES if importlib.util.find_spec(m) is None]
if _missing:
    raise ModuleNotFoundError(f"missing {', '.join(_missing)}", name=_missing[0])

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).with_name("locust_mix.py")
MAX_USERS = 200
MAX_DURATION_S = 3600
LOCUST_CLASSES = {"online": "OnlineChatUser", "offline": "OfflineUser", "batch": "BatchSubmitter",
                  "bad": "MisbehavingUser"}

loadtest_app = typer.Typer(add_completion=False)


@dataclass(slots=True, frozen=True)
class LoadTestOptions:
    url: str
    admin_key: str
    users: int
    duration_s: int
    mix: str
    out_dir: Path
    model: str | None = None
    max_tokens: int = 32
    offline_prompt_words: int = 300
    batch_lines: int = 4
    oversize_bytes: int = (1 << 20) + 4096
    stop_timeout_s: float = 60.0
    keep_tenants: bool = False


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@loadtest_app.callback(invoke_without_command=True, subcommand_metavar="")
def loadtest(
    users: Annotated[int, typer.Option(min=1, max=MAX_USERS, help="simulated users in all")] = 10,
    duration: Annotated[int, typer.Option(min=5, max=MAX_DURATION_S, help="seconds of load")] = 60,
    mix: Annotated[str, typer.Option(help="each class's share of the users: online, offline, batch, bad")
                   ] = "online=0.5,offline=0.2,batch=0.1,bad=0.2",
    out: Annotated[Path, typer.Option(help="output folder (CSVs, HTML, plots, summary)")] = Path("loadtest-out"),
    url: Annotated[str, typer.Option(help="the gateway (loopback unless --allow-remote)")
                   ] = "http://127.0.0.1:8000",
    admin_key: Annotated[str | None, typer.Option(envvar="LOCKGATE_ADMIN_KEY", show_envvar=True,
                                                  help="an admin key, to make the tenants")] = None,
    model: Annotated[str | None, typer.Option(help="the model to call (default: the first listed)")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=512, help="online and batch answers (offline: twice)")
                          ] = 32,
    offline_prompt_words: Annotated[int, typer.Option(min=1, max=1500)] = 300,
    batch_lines: Annotated[int, typer.Option(min=1, max=5000, help="requests in each batch job's file")] = 4,
    slo_online_ttft_ms: Annotated[float, typer.Option(min=0)] = 1000.0,
    slo_online_tpot_ms: Annotated[float, typer.Option(min=0)] = 250.0,
    slo_batch_s: Annotated[float, typer.Option(min=0, help="a batch's upload-to-output target")] = 300.0,
    slo_goal: Annotated[float, typer.Option(min=0, max=1, help="attainment a class needs")] = 0.9,
    oversize_bytes: Annotated[int, typer.Option(min=1, help="the misbehaving users' body; over the gateway's "
                                                "LOCKGATE_MAX_BODY_BYTES")] = (1 << 20) + 4096,
    stop_timeout: Annotated[float, typer.Option(min=0, max=600, help="seconds requests in flight at the end get")
                            ] = 60.0,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow a gateway beyond loopback")
                            ] = False,
    keep_tenants: Annotated[bool, typer.Option("--keep-tenants", help="do not delete the tenants afterwards")
                            ] = False,
) -> None:
    """Run a multi-tenant load test against a running `lockgate serve`, with verdicts."""
    from lockgate.loadtests.loadtest_setup import parse_mix, users_per_class

    if not allow_remote and not is_loopback(url):
        raise typer.BadParameter(f"{urlsplit(url).hostname} is not a loopback address; add --allow-remote",
                                 param_hint="--url")
    if not admin_key:
        raise typer.BadParameter("give an admin key (or set LOCKGATE_ADMIN_KEY)", param_hint="--admin-key")
    try:
        users_per_class(users, parse_mix(mix))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mix") from None
    opts = LoadTestOptions(url=url.rstrip("/"), admin_key=admin_key, users=users, duration_s=duration,
                           mix=mix, out_dir=out, model=model, max_tokens=max_tokens,
                           offline_prompt_words=offline_prompt_words, batch_lines=batch_lines,
                           oversize_bytes=oversize_bytes,
                           stop_timeout_s=stop_timeout,
                           keep_tenants=keep_tenants)
    targets = SloTargets(online_ttft_ms=slo_online_ttft_ms, online_tpot_ms=slo_online_tpot_ms,
                         batch_turnaround_s=slo_batch_s, goal=slo_goal)
    try:
        summary = run_loadtest(opts, targets)
    except RuntimeError as exc:
        typer.echo(f"lockgate loadtest: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if summary["passed"] else 1)


def run_loadtest(opts: LoadTestOptions, targets: SloTargets) -> dict:
    """Tenants, the locust run, the summary and plots; the summary. RuntimeError when the
    gateway cannot be used or locust fails."""
    import httpx

    from lockgate.loadtests.loadtest_setup import (
        Admin,
        first_model,
        locust_config,
        new_run_id,
        parse_mix,
        users_per_class,
    )

    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("samples-*.jsonl"):
        old.unlink()
    class_users = users_per_class(opts.users, parse_mix(opts.mix))
    admin = Admin(opts.url, opts.admin_key)
    tenants: list[Tenant] = []
    try:
        admin.check()
        tenants = admin.create_tenants(new_run_id())
        model = opts.model or first_model(opts.url, tenants[0].key)
        config = locust_config(
            tenants, class_users, model=model, samples_dir=str(out.resolve()),
            max_tokens=opts.max_tokens, offline_max_tokens=2 * opts.max_tokens,
            offline_prompt_words=opts.offline_prompt_words, batch_lines=opts.batch_lines,
            batch_poll_s=1.0, batch_timeout_s=opts.duration_s + opts.stop_timeout_s,
            oversize_bytes=opts.oversize_bytes)
        started = time.time()
        run_locust(opts, config, class_users)
        samples = read_samples(out)
        samples += finish_stragglers(opts, samples, tenants)
        billed = {t.name: admin.usage(t) for t in tenants}
        return write_outputs(opts, targets, samples, tenants, billed, model=model, started=started)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"a call to {opts.url} failed: {exc!r}") from None
    finally:
        if not opts.keep_tenants:
            with contextlib.suppress(httpx.HTTPError):
                admin.delete_tenants(tenants)
        admin.close()


def run_locust(opts: LoadTestOptions, config: dict, class_users: dict[str, int]) -> None:
    """locust headless in a subprocess (its log in locust.log), a progress line meanwhile."""
    out = opts.out_dir
    classes = [LOCUST_CLASSES[c] for c, n in class_users.items() if n > 0]
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *classes, "--headless",
           "-u", str(opts.users), "-r", str(opts.users), "-t", f"{opts.duration_s}s",
           "--stop-timeout", f"{opts.stop_timeout_s:g}", "--host", opts.url, "--only-summary",
           "--csv", str(out / "locust"), "--html", str(out / "locust.html"), "--exit-code-on-error", "0"]
    env = {**os.environ, "LOCKGATE_LOADTEST": json.dumps(config), "PYTHONPATH": str(REPO)}
    limit = opts.duration_s + opts.stop_timeout_s + 60
    progress = Progress(out, opts.duration_s)
    with open(out / "locust.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            progress.follow(proc, limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"locust ran past {limit:.0f} s and was killed (see {out / 'locust.log'})") from None
    progress.finish()
    if proc.returncode != 0:
        tail = (out / "locust.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust exited with {proc.returncode}:\n{tail}")


class Progress:
    """One line on stderr, rewritten every 2 s on a terminal and printed every 5 s otherwise:
    time, and per class the requests answered as expected, refused and failed so far."""

    def __init__(self, out_dir: Path, duration_s: float) -> None:
        self.out_dir, self.duration_s = out_dir, duration_s
        self.tty = sys.stderr.isatty()
        self.offsets: dict[Path, int] = {}
        self.counts: Counter[tuple[str, str]] = Counter()
        self.start = time.monotonic()

    def _read(self) -> None:
        for path in self.out_dir.glob("samples-*.jsonl"):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                s = json.loads(line)
                self.counts[s["cls"], s["outcome"]] += 1

    def line(self) -> str:
        self._read()
        elapsed = time.monotonic() - self.start
        classes = sorted({c for c, _ in self.counts}, key=list(LOCUST_CLASSES).index)
        parts = [f"{c} {self.counts[c, 'ok'] + self.counts[c, 'expected']}" for c in classes]
        refused = sum(n for (_, o), n in self.counts.items() if o == "refused")
        failed = sum(n for (_, o), n in self.counts.items() if o == "failed")
        phase = f"{min(elapsed, self.duration_s):3.0f}/{self.duration_s:.0f} s" if elapsed <= self.duration_s \
            else "finishing in-flight requests"
        return f"[{phase}] served: {', '.join(parts) or '-'}; refused {refused}; failed {failed}"

    def follow(self, proc: subprocess.Popen, limit: float) -> None:
        every = 2.0 if self.tty else 5.0
        deadline = time.monotonic() + limit
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, limit)
            time.sleep(min(every, max(0.1, deadline - time.monotonic())))
            text = self.line()
            sys.stderr.write(f"\r{text:<100}" if self.tty else text + "\n")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def read_samples(out_dir: Path) -> list[dict]:
    samples = []
    for path in sorted(out_dir.glob("samples-*.jsonl")):
        samples += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return samples


def finish_stragglers(opts: LoadTestOptions, samples: list[dict], tenants: list[Tenant]) -> list[dict]:
    """Samples for batches created but not collected before locust stopped (their tokens are
    billed, so the load test collects them, as their submitter would have)."""
    from lockgate.loadtests.loadtest_setup import finish_batches

    collected = {s.get("batch_id") for s in samples if s["name"] == "batch job"}
    created = [s for s in samples if s["outcome"] == "created" and s["batch_id"] not in collected]
    extra = []
    for t in tenants:
        mine = [s for s in created if s["tenant"] == t.name]
        if not mine:
            continue
        results = finish_batches(opts.url, t.key, [s["batch_id"] for s in mine], opts.stop_timeout_s)
        for s, result in zip(mine, results, strict=True):
            extra.append({"t": time.time(), "start": s["start"], "cls": "batch", "tenant": t.name,
                          "name": "batch job", "status": 200, "after_run": True, **result})
    return extra


def shown_command(args: list[str]) -> str:
    """The command line as the summary shows it: an admin key given on it left out."""
    shown, skip = ["lockgate", "loadtest"], False
    for arg in args:
        if skip or arg.startswith("--admin-key"):
            skip = arg == "--admin-key"
            continue
        shown.append(arg)
    return " ".join(shown)


def write_outputs(opts: LoadTestOptions, targets: SloTargets, samples: list[dict], tenants: list[Tenant],
                  billed: dict, *, model: str, started: float) -> dict:
    """summary.json, summary.md (also printed) and the plots; the summary. The run's time is
    from the first request's start to the last one's end."""
    from lockgate.loadtests.loadtest_plots import plot_all
    from lockgate.loadtests.loadtest_summary import summarize, to_markdown

    t0 = min((s["start"] for s in samples), default=started)
    duration = max(1.0, max((s["t"] for s in samples), default=t0 + opts.duration_s) - t0)
    run = {"url": opts.url, "users": opts.users, "mix": opts.mix, "model": model, "load_s": opts.duration_s,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
           "command": shown_command(sys.argv[2:])}
    summary = summarize(samples, [t.public() for t in tenants], billed, duration_s=duration,
                        targets=targets, run=run)
    summary["plots"] = [p.name for p in plot_all(samples, opts.out_dir, t0=t0, duration_s=duration)]
    (opts.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = to_markdown(summary)
    (opts.out_dir / "summary.md").write_text(markdown)
    typer.echo(markdown)
    typer.echo(f"wrote {opts.out_dir}/: summary.md, summary.json, {', '.join(summary['plots'])}, "
               "locust_*.csv, locust.html, samples-*.jsonl")
    return summary
