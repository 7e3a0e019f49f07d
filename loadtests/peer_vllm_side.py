"""The vLLM side of `lockgate bench throughput --peer vllm`, run by the peer's own Python
(`.venv-vllm/bin/python`, made by scripts/peer-vllm.sh): it imports only vLLM and the
standard library, never Lockgate. Reads a job (JSON) on stdin, writes one JSON line of
results on stdout, prefixed so that vLLM's own prints cannot be mistaken for it.

Job: {"model": dir, "requests": [[prompt ids], output_len]..., "max_model_len": n,
      "max_num_seqs": n, "max_num_batched_tokens": n, "kv_space_gib": n}
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

RESULT_PREFIX = "LOCKGATE-PEER-RESULT "


def main() -> None:
    job = json.loads(sys.stdin.read())
    # one process: the engine core in this one, so its peak RSS and CPU time are this
    # process's own (vLLM's default runs the core in a child)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_space_gib", 2)))
    # the cores this process may run on (a container's cpuset), not the host's count
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    t_import = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t_import
    requests = job["requests"]
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              seed=0, skip_tokenizer_init=False)
    llm.generate([{"prompt_token_ids": requests[0][0]}],
                 SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    startup_s = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
              for _, n in requests]
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    import vllm

    result = {"elapsed_s": elapsed, "cpu_s": cpu, "output_tokens": sum(n for _, n in requests),
              "tokens": tokens, "startup_s": startup_s, "import_s": import_s, "peak_rss_mib": peak,
              "version": vllm.__version__}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)    # vLLM's atexit teardown can take seconds and print; the result is out


if __name__ == "__main__":
    main()
