"""`lockgate bench throughput --peer vllm`: Lockgate's engine against vLLM's CPU build on one
fixed-seed offline workload, in one run.

- The two sides alternate, each run in a fresh process (vLLM's in its own venv, made by
  scripts/peer-vllm.sh, so its pinned versions never meet ours), `repeats` runs each; the
  fastest of each side counts, and the ratio of those is printed.
- Both sides' greedy tokens are compared with HF transformers' (batch 1, no padding: the
  oracle), in a fresh process of its own.
- The bench measures the machine's roofline itself: sgemm FLOP/s (a large fp32 matmul) and
  memory bandwidth (a large copy), best of several, and prints each side's share of it: the
  workload's model FLOPs over its time against the sgemm peak, and the roofline bound (the
  least time those FLOPs and the bytes a step must read could take) over its time.
- `--scaling` adds tokens/s at 16, 64 and 256 concurrent sequences, and time per output
  token for one decoder layer of Llama-2-7B's shape (random weights) at batch 1 and 32.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lockgate.loadtests.bench_throughput import _in_fresh_process, _workload, default_model_dir, run_engine
from lockgate.loadtests.cache import cache_dir
from lockgate.loadtests.neighbour import Neighbours
from lockgate.loadtests.workload import OfflineRequest

REPO = Path(__file__).resolve().parent.parent
PEER_TIMEOUT_S = 1800.0
RESULT_PREFIX = "LOCKGATE-PEER-RESULT "


class PeerUnavailable(RuntimeError):
    pass


def peer_python(peer: str) -> Path:
    if peer != "vllm":
        raise PeerUnavailable(f"--peer: only 'vllm' is known, got {peer!r}")
    venv = Path(os.environ.get("LOCKGATE_PEER_VENV") or REPO / ".venv-vllm")
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerUnavailable(f"no vLLM venv at {venv}: run `bash scripts/peer-vllm.sh` first "
                              "(or set LOCKGATE_PEER_VENV)")
    return python


# -- the vLLM side ---------------------------------------------------------------------------
def run_vllm(python: Path, model_dir: str, work: list[OfflineRequest], max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    job = {"model": model_dir, "requests": [[r.prompt_token_ids, r.output_len] for r in work],
           "max_model_len": max(len(r.prompt_token_ids) + r.output_len for r in work) + 16,
           "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
           "kv_space_gib": 2}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    # a session of its own, so that a timeout kills whatever the peer started too
    proc = subprocess.Popen([str(python), str(Path(__file__).with_name("peer_vllm_side.py"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(json.dumps(job), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise PeerUnavailable(f"the vLLM side took over {timeout_s:.0f} s") from None
    except BaseException:          # Ctrl-C too: its own session never sees the terminal's SIGINT
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise PeerUnavailable(f"the vLLM side failed (exit {proc.returncode}): {stderr.strip()[-3000:]}")


# -- the oracle ------------------------------------------------------------------------------
def run_hf_oracle(model_dir: str, num_requests: int, seed: int) -> list[list[int]]:
    """HF transformers' greedy tokens, one request at a time (no padding to perturb them)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    work = _workload(model_dir, num_requests, seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for r in work:
            ids = torch.tensor([r.prompt_token_ids])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=r.output_len, min_new_tokens=r.output_len, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def near_ties(model_dir: str, num_requests: int, seed: int, got: dict[str, list[list[int]]],
              oracle: list[list[int]]) -> dict[str, list[dict[str, Any]]]:
    """For each side's request that differs from HF: where it first differs, and HF's own
    logits there (float64 from HF's float32 forward): the top two and their gap, so a flip at
    a float32 near-tie tells itself apart from a wrong token."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    work = _workload(model_dir, num_requests, seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, list[dict[str, Any]]] = {}
    for side, tokens in got.items():
        for i, (a, b) in enumerate(zip(tokens, oracle, strict=True)):
            if a == b:
                continue
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            ids = torch.tensor([work[i].prompt_token_ids + b[:j]])
            with torch.inference_mode():
                logits = model(ids).logits[0, -1].double()
            top = logits.topk(2).values.tolist()
            side_logit = float(logits[a[j]]) if j < len(a) else float("nan")
            gap = top[0] - side_logit
            out.setdefault(side, []).append({"request": i, "position": j, "hf_top2": top,
                                             "side_token_logit": side_logit,
                                             "gap": gap, "relative_gap": gap / max(abs(top[0]), 1e-30)})
    return out


# -- the machine's roofline -------------------------------------------------------------------
def measure_peaks(repeats: int = 5) -> dict[str, float]:
    """sgemm FLOP/s (a 2048^3 fp32 matmul, the faster of torch.mm (MKL) and oneDNN with a
    packed weight, which may use wider vectors than MKL does on a given CPU: the machine's
    best, not Lockgate's own kernel) and memory bandwidth (a 256 MiB copy: read + write),
    best of `repeats`, torch's default threads."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best_mm = min(_timed(lambda: torch.mm(a, b, out=c)) for _ in range(repeats))
    ops = torch.ops.mkldnn
    if torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise"):
        packed = ops._reorder_linear_weight(b)
        ops._linear_pointwise(a, packed, None, "none", [], "")
        best_mm = min(best_mm, *(_timed(lambda: ops._linear_pointwise(a, packed, None, "none", [], ""))
                                 for _ in range(repeats)))
    src = torch.ones(64 * 1024 * 1024)     # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return {"sgemm_flops": 2 * n**3 / best_mm, "bandwidth_bytes": 2 * src.numel() * 4 / best_copy,
            "threads": torch.get_num_threads()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def workload_cost(model_dir: str, work: list[OfflineRequest], max_num_batched_tokens: int = 2048) -> dict[str, float]:
    """The workload's model FLOPs, and the least bytes its steps must read (fp32): the
    weights once per forward (prefill forwards of `max_num_batched_tokens` tokens, one decode
    forward per output position of the longest request) and each decode's K/V context."""
    from lockgate.engine.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer_macs = h * (q + 2 * kv) + q * h + 3 * h * inter
    head_macs = h * cfg.vocab_size
    prompt = sum(len(r.prompt_token_ids) for r in work)
    outputs = sum(r.output_len for r in work)
    flops = 2 * layer_macs * layers * (prompt + outputs) + 2 * head_macs * (outputs + len(work))
    attn_ctx = 0     # sum over query tokens of the context each attends to
    for r in work:
        p = len(r.prompt_token_ids)
        attn_ctx += p * (p + 1) // 2 + sum(p + i for i in range(1, r.output_len))
    flops += 4 * q * layers * attn_ctx            # QK^T and PV, every query head
    weight_bytes = 4 * (layers * layer_macs + head_macs)
    forwards = -(-prompt // max_num_batched_tokens) + max(r.output_len for r in work)
    kv_bytes = 4 * 2 * kv * layers * sum(sum(len(r.prompt_token_ids) + i for i in range(1, r.output_len))
                                         for r in work)
    return {"flops": float(flops), "bytes": float(weight_bytes * forwards + kv_bytes)}


# -- a Llama-2-7B-shaped decoder layer -------------------------------------------------------
def layer7b_model_dir() -> Path:
    """One decoder layer of Llama-2-7B's shape (hidden 4096, 32 heads, MLP 11008), random
    weights, with the small demo model's tokenizer and vocabulary (8k, so the head does not
    swamp the layer), fp32, written once under the bench cache."""
    path = cache_dir() / "demo-models" / "llama-7b-layer-seed0"
    if (path / "model.safetensors").is_file():
        return path
    from safetensors.torch import save_file

    small = default_model_dir()
    cfg = json.loads((small / "config.json").read_text())
    cfg.update(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               head_dim=128, num_hidden_layers=1, max_position_embeddings=4096)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    cfg["rope_theta"] = 10000.0
    g = torch.Generator().manual_seed(7)
    h, inter, vocab = 4096, 11008, cfg["vocab_size"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    p = "model.layers.0."
    sd = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h),
          "model.norm.weight": torch.ones(h), p + "input_layernorm.weight": torch.ones(h),
          p + "post_attention_layernorm.weight": torch.ones(h)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[p + f"self_attn.{name}.weight"] = w(h, h)
    sd[p + "mlp.gate_proj.weight"] = w(inter, h)
    sd[p + "mlp.up_proj.weight"] = w(inter, h)
    sd[p + "mlp.down_proj.weight"] = w(h, inter)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".tmp"))
    try:
        for f in small.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                (tmp / f.name).write_bytes(f.read_bytes())
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.rename(path)
    except OSError:
        if (path / "model.safetensors").is_file():     # another bench wrote it meanwhile
            return path
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def layer_workload(model_dir: str, batch: int, prompt_len: int = 128, output_len: int = 32) -> list[OfflineRequest]:
    work = _workload(model_dir, batch, 1)
    return [OfflineRequest((r.prompt_token_ids * (prompt_len // len(r.prompt_token_ids) + 1))[:prompt_len],
                           output_len) for r in work]


def _engine_on(model_dir: str, work: list[OfflineRequest]) -> dict[str, Any]:
    """run_engine on a given list of requests (the scaling and 7B-layer cases)."""
    import lockgate.loadtests.bench_throughput as bt

    bt._workload = lambda *_: work     # this fresh process runs only this workload
    return run_engine(model_dir, len(work), 0, {})


# -- the run ---------------------------------------------------------------------------------
def bench_peer(
    model_dir: str | None = None,
    *,
    peer: str = "vllm",
    num_requests: int = 64,
    seed: int = 0,
    repeats: int = 3,
    scaling: bool = False,
    json_out: str | None = None,
    neighbour: int = 0,
    echo=print,
) -> dict[str, Any]:
    """`neighbour`: both sides run beside that many processes each burning a core, and the
    engine also runs alone (`lockgate-quiet`), alternating with them."""
    python = peer_python(peer)
    model_dir = str(model_dir or default_model_dir())
    work = _workload(model_dir, num_requests, seed)
    echo(f"workload: {num_requests} requests, prompts 32-512 tokens, outputs 16-256 (forced), greedy, "
         f"fp32, seed {seed}, model {model_dir}; peer {peer} ({python})")
    peaks = _in_fresh_process(measure_peaks)
    echo(f"machine: sgemm {peaks['sgemm_flops'] / 1e9:.1f} GFLOP/s, copy bandwidth "
         f"{peaks['bandwidth_bytes'] / 1e9:.1f} GB/s ({peaks['threads']} threads)")
    results = _alternate(python, model_dir, work, num_requests, seed, repeats, neighbour, echo)
    oracle = _in_fresh_process(run_hf_oracle, model_dir, num_requests, seed)
    cost = workload_cost(model_dir, work)
    report = _report(results, oracle, peaks, cost, echo)
    if neighbour:
        report["neighbour"] = _neighbour_report(results, neighbour, echo)
    if not report["both_equal_hf"]:
        ties = _in_fresh_process(near_ties, model_dir, num_requests, seed,
                                 {s: results[s]["tokens"] for s in results}, oracle)
        report["differences"] = ties
        for side, rows in ties.items():
            for t in rows:
                echo(f"  {side}: request {t['request']} first differs at output {t['position']}: HF's top two "
                     f"logits {t['hf_top2'][0]:.5f} / {t['hf_top2'][1]:.5f}, "
                     f"{side}'s token {t['side_token_logit']:.5f} "
                     f"(gap {t['gap']:.2e}, {t['relative_gap']:.1e} relative)")
    if scaling:
        report["scaling"] = _scaling(python, model_dir, seed, echo)
    if json_out:
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}
        Path(json_out).write_text(json.dumps({"results": slim, **report}, indent=2))
    return report


def _alternate(python: Path, model_dir: str, work: list[OfflineRequest], num_requests: int, seed: int,
               repeats: int, neighbour: int, echo) -> dict[str, dict[str, Any]]:
    """Each side `repeats` times, the order turned round every repeat, each run in a fresh
    process (beside `neighbour` burning processes but for `lockgate-quiet`); the fastest
    run of each side."""
    sides = ("lockgate", "vllm") + (("lockgate-quiet",) if neighbour else ())
    results: dict[str, dict[str, Any]] = {}
    for rep in range(repeats):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            with Neighbours(neighbour if side != "lockgate-quiet" else 0):
                run = (_in_fresh_process(run_engine, model_dir, num_requests, seed, {})
                       if side.startswith("lockgate") else run_vllm(python, model_dir, work))
            echo(f"  run {rep + 1}/{repeats} {side:<15} {run['output_tokens'] / run['elapsed_s']:8.1f} tok/s")
            if side not in results or run["elapsed_s"] < results[side]["elapsed_s"]:
                results[side] = run
    return results


def _neighbour_report(results: dict[str, dict[str, Any]], neighbour: int, echo) -> dict[str, float]:
    tps = {s: r["output_tokens"] / r["elapsed_s"] for s, r in results.items()}
    out = {"quiet_tokens_per_s": tps["lockgate-quiet"], "of_quiet": tps["lockgate"] / tps["lockgate-quiet"],
           "vs_vllm": tps["lockgate"] / tps["vllm"], "threads": results["lockgate"].get("threads")}
    echo(f"beside {neighbour} process(es) burning a core each: lockgate {tps['lockgate']:.1f} tok/s, "
         f"{out['of_quiet']:.2f}x of its quiet {tps['lockgate-quiet']:.1f} (target >= 0.45), "
         f"{out['vs_vllm']:.2f}x vLLM's {tps['vllm']:.1f} beside the same (target >= 1.0, goal 1.2); "
         f"the engine's threads at the end: {out['threads']}")
    return out


def _report(results, oracle, peaks, cost, echo) -> dict[str, Any]:
    echo("")
    echo(f"{'side':<12}{'output tok/s':>14}{'seconds':>9}{'CPU s':>8}{'start-up s':>12}{'peak RSS MiB':>14}"
         f"{'= HF':>8}{'sgemm share':>13}{'roofline share':>16}")
    report: dict[str, Any] = {"peaks": peaks, "cost": cost}
    bound_s = max(cost["flops"] / peaks["sgemm_flops"], cost["bytes"] / peaks["bandwidth_bytes"])
    for side in ("lockgate", "vllm"):
        r = results[side]
        tps = r["output_tokens"] / r["elapsed_s"]
        same = sum(a == b for a, b in zip(r["tokens"], oracle, strict=True))
        flop_share = cost["flops"] / r["elapsed_s"] / peaks["sgemm_flops"]
        roof_share = bound_s / r["elapsed_s"]
        report[side] = {"tokens_per_s": tps, "startup_s": r["startup_s"], "peak_rss_mib": r["peak_rss_mib"],
                        "equal_to_hf": same, "sgemm_share": flop_share, "roofline_share": roof_share}
        echo(f"{side:<12}{tps:>14.1f}{r['elapsed_s']:>9.2f}{r['cpu_s']:>8.2f}{r['startup_s']:>12.2f}"
             f"{r['peak_rss_mib']:>14.0f}{f'{same}/{len(oracle)}':>8}"
             f"{flop_share * 100:>12.1f}%{roof_share * 100:>15.1f}%")
    ratio = report["lockgate"]["tokens_per_s"] / report["vllm"]["tokens_per_s"]
    report["ratio"] = ratio
    echo("")
    echo(f"workload: {cost['flops'] / 1e9:.1f} GFLOP of model arithmetic, {cost['bytes'] / 1e9:.2f} GB the steps "
         f"must read at least; roofline bound {bound_s:.2f} s")
    echo(f"ratio lockgate / vllm (output tok/s): {ratio:.2f}x (target >= 1.2)")
    both = all(report[s]["equal_to_hf"] == len(oracle) for s in ("lockgate", "vllm"))
    report["both_equal_hf"] = both
    echo(f"both sides' greedy tokens equal HF's on every request: {'yes' if both else 'NO'}")
    return report


def _scaling(python: Path, model_dir: str, seed: int, echo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    echo("")
    echo("scaling: tokens/s at N concurrent sequences (one run each side)")
    for n in (16, 64, 256):
        work = _workload(model_dir, n, seed)
        e = _in_fresh_process(_engine_on, model_dir, work)
        v = run_vllm(python, model_dir, work)
        te, tv = e["output_tokens"] / e["elapsed_s"], v["output_tokens"] / v["elapsed_s"]
        out[f"seqs_{n}"] = {"lockgate": te, "vllm": tv}
        echo(f"  {n:>4} sequences: lockgate {te:8.1f} tok/s, vllm {tv:8.1f} tok/s, {te / tv:.2f}x")
    layer_dir = str(layer7b_model_dir())
    echo("one Llama-2-7B-shaped decoder layer (random weights, 8k vocabulary), fp32, prompts of 128, "
         "32 output tokens: time per output token")
    for batch in (1, 32):
        work = layer_workload(layer_dir, batch)
        e = _in_fresh_process(_engine_on, layer_dir, work)
        try:
            v = run_vllm(python, layer_dir, work)
            tv = v["elapsed_s"] / work[0].output_len * 1e3
        except PeerUnavailable as exc:
            v, tv = None, float("nan")
            echo(f"  vLLM could not run the layer: {str(exc)[-300:]}")
        te = e["elapsed_s"] / work[0].output_len * 1e3
        out[f"layer7b_batch_{batch}"] = {"lockgate_ms": te, "vllm_ms": tv}
        echo(f"  batch {batch:>2}: lockgate {te:7.1f} ms/token, vllm {tv:7.1f} ms/token")
    return out


if __name__ == "__main__":   # pragma: no cover - `lockgate bench throughput --peer vllm` is the way in
    bench_peer(*sys.argv[1:2])
