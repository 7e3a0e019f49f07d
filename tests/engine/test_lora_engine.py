"""Multi-LoRA in the engine: one batch mixes several adapters and the bare base model, and
each request's greedy output equals HF transformers + peft running its adapter alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockgate.engine import LLM, LoRAError, LoRARequest, SamplingParams
from lockgate.engine.lora_demo import write_demo_adapter
from tests.support.helpers import demo_model, hf_greedy, random_prompts
from tests.support.lora import peft_greedy
from tests.support.quant import dequantize_checkpoint, run_quantize, write_hf_twin

NEW_TOKENS = 12
# rank, targets, seed, rslora: ranks differ (zero-padded in one slot tensor), targets differ
ADAPTERS = {
    "qv": (8, "q,v", 1),
    "all": (4, "q,k,v,o,gate,up,down", 2),
    "mlp": (16, "gate,up,down", 3),
    "ko": (2, "k,o", 4),
    "qd": (6, "q,down", 5),
}


@pytest.fixture(scope="module")
def base() -> str:
    return demo_model("llama", "tiny", 0)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (rank, targets, seed)) in enumerate(ADAPTERS.items(), start=1):
        path = write_demo_adapter(base, root / name, rank=rank, targets=targets, seed=seed)
        out[name] = LoRARequest(name, i, str(path))
    return out


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_mixed_batch_matches_peft_per_adapter(base, adapters):
    """Three adapters and the base model, interleaved in one batch (and one step: all
    prompts fit the token budget), chunked prefill included; every output equals peft."""
    names = ["qv", None, "all", "mlp", None, "qv", "all", "mlp"]
    prompts = random_prompts(base, [5, 17, 33, 9, 64, 40, 3, 100], seed=11)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_batched_tokens=64, num_kv_blocks=64)
    loras = [adapters[n] if n else None for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), lora_request=loras,
                        use_progress_bar=False)
    changed = 0
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        path = adapters[name].lora_path if name else None
        want = peft_greedy(base, path, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, f"adapter {name}"
        if name:
            changed += want != hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)
    assert changed >= 4, "the adapters should change most continuations, or the test proves little"
    stats = llm.engine.stats().lora
    assert stats.slot_loads == 3 and stats.disk_loads == 3
    assert llm.engine.kv.num_used_blocks == 0


def test_more_adapters_than_slots_take_turns(base, adapters):
    """Five adapters, two slots: every adapter's requests are served, outputs still equal
    peft, and no step ever runs more than two adapters. The first adapter's requests keep
    arriving (a popular adapter) yet the others are served before its last ones."""
    order = ["qv"] * 6 + ["all", "mlp", "ko", "qd"] + ["qv"] * 4
    prompts = random_prompts(base, [8 + 3 * i for i in range(len(order))], seed=12)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=3, max_num_seqs=4, num_kv_blocks=64)
    core = llm.engine
    seen_per_step: list[set[int]] = []
    finish_order: list[str] = []
    runner_prepare = core.runner.prepare

    def spy(sched, kv):
        seen_per_step.append({s.state.req.lora_id for s, _ in sched.scheduled} - {0})
        return runner_prepare(sched, kv)

    core.runner.prepare = spy
    for i, (name, prompt) in enumerate(zip(order, prompts, strict=True)):
        llm.add_lora(adapters[name])
        core.add_request(_request(str(i), prompt, adapters[name]))
    outs = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                outs[out.request_id] = out
                finish_order.append(order[int(out.request_id)])
    assert max(len(s) for s in seen_per_step) <= 2
    for i, (name, prompt) in enumerate(zip(order, prompts, strict=True)):
        assert outs[str(i)].outputs[0].token_ids == peft_greedy(base, adapters[name].lora_path, prompt, NEW_TOKENS)
    # rotation: the four later adapters all finish before the popular adapter's last request
    last_qv = len(finish_order) - 1 - finish_order[::-1].index("qv")
    assert all(finish_order.index(n) < last_qv for n in ("all", "mlp", "ko", "qd")), finish_order
    stats = core.stats().lora
    assert stats.slot_loads >= 5
    assert len(stats.in_cpu) <= 3, "the CPU cache keeps max_cpu_loras once no request holds them"
    assert core.kv.num_used_blocks == 0


def _request(rid, prompt, lora):
    from lockgate.engine.request import EngineRequest

    return EngineRequest(rid, prompt, greedy(), lora_request=lora)


def test_prefix_cache_is_per_adapter(base, adapters):
    """The same prompt under another adapter must not reuse the first one's KV blocks."""
    prompt = random_prompts(base, [80], seed=13)[0]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64)
    p = {"prompt_token_ids": prompt}
    first = llm.generate(p, greedy(), lora_request=adapters["qv"])[0]
    again = llm.generate(p, greedy(), lora_request=adapters["qv"])[0]
    other = llm.generate(p, greedy(), lora_request=adapters["all"])[0]
    plain = llm.generate(p, greedy())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert other.outputs[0].token_ids == peft_greedy(base, adapters["all"].lora_path, prompt, NEW_TOKENS)


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(base, adapters, tmp_path):
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    prompt = {"prompt_token_ids": random_prompts(base, [10], seed=14)[0]}
    # rank over max_lora_rank
    with pytest.raises(LoRAError, match=r"rank 16 .* exceeds max_lora_rank 8"):
        llm.generate(prompt, greedy(), lora_request=adapters["mlp"])
    # an adapter of another base model (qwen2 tiny has other shapes or layers)
    other_base = demo_model("llama", "small", 0)
    foreign = write_demo_adapter(other_base, tmp_path / "foreign", rank=4, targets="q,v", seed=1)
    with pytest.raises(LoRAError, match="another base model"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("foreign", 20, str(foreign)))
    # a corrupt safetensors file
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((Path(adapters["qv"].lora_path) / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with pytest.raises(LoRAError, match=r"adapter_model\.safetensors: cannot be read"):
        llm.generate(prompt, greedy(), lora_request=LoRARequest("corrupt", 21, str(corrupt)))
    # missing directory, bad config, DoRA, one id for two adapters, LoRA not enabled
    with pytest.raises(LoRAError, match="is not a directory"):
        llm.add_lora(LoRARequest("missing", 22, str(tmp_path / "nope")))
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((Path(adapters["qv"].lora_path) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    weights = Path(adapters["qv"].lora_path) / "adapter_model.safetensors"
    (dora / "adapter_model.safetensors").write_bytes(weights.read_bytes())
    with pytest.raises(LoRAError, match="use_dora"):
        llm.add_lora(LoRARequest("dora", 23, str(dora)))
    llm.add_lora(adapters["qv"])
    with pytest.raises(LoRAError, match="id 1 is already adapter 'qv'"):
        llm.add_lora(LoRARequest("impostor", 1, adapters["all"].lora_path))
    with pytest.raises(LoRAError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    # nothing half-loaded: the engine still serves base and adapter requests exactly
    stats = llm.engine.stats().lora
    assert set(stats.in_cpu) == {"qv"} and stats.requests == {}
    out = llm.generate([prompt, prompt], greedy(), lora_request=[adapters["qv"], None])
    assert out[0].outputs[0].token_ids == peft_greedy(base, adapters["qv"].lora_path, prompt["prompt_token_ids"],
                                                      NEW_TOKENS)
    assert out[1].outputs[0].token_ids == hf_greedy(base, prompt["prompt_token_ids"], NEW_TOKENS, ignore_eos=True)
    plain = LLM(base, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(prompt, greedy(), lora_request=adapters["qv"])


def test_rslora_scaling_matches_peft(base, adapters, tmp_path):
    """use_rslora: scaling alpha / sqrt(r) rather than alpha / r, as peft computes it."""
    src = Path(adapters["all"].lora_path)
    rs = tmp_path / "rs"
    rs.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (rs / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    (rs / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    prompts = random_prompts(base, [7, 30], seed=15)
    llm = LLM(base, dtype="float32", enable_lora=True, num_kv_blocks=32)
    req = LoRARequest("rs", 30, str(rs))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), lora_request=req)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy(base, str(rs), prompt, NEW_TOKENS)


async def test_async_engine_serves_adapters_by_name(base, adapters, tmp_path):
    """AsyncEngine: adapters registered by name, requested with model=<name>, mixed with the
    base model in one run; an adapter unloaded from memory is read again (off the step loop)
    on its next request; a removed one is unknown; bad registrations change nothing."""
    from lockgate.engine import AsyncEngine, UnknownModel

    prompts = random_prompts(base, [9, 21, 14], seed=16)
    async with AsyncEngine(base, dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64) as engine:
        await engine.add_lora(adapters["qv"])
        await engine.add_lora(adapters["all"])
        with pytest.raises(LoRAError, match="already registered"):
            await engine.add_lora(LoRARequest("qv", 9, adapters["mlp"].lora_path))
        with pytest.raises(LoRAError, match="another base model"):
            other = write_demo_adapter(demo_model("llama", "small", 0), tmp_path / "f", rank=2, seed=1)
            await engine.add_lora(LoRARequest("foreign", 10, str(other)))
        assert set(engine.loras) == {"qv", "all"}

        async def run(model, prompt, rid):
            last = None
            async for out in engine.generate({"prompt_token_ids": prompt}, greedy(), rid, model=model):
                last = out
            return last.outputs[0].token_ids

        import asyncio
        got = await asyncio.gather(run("qv", prompts[0], "a"), run(None, prompts[1], "b"),
                                   run("all", prompts[2], "c"))
        assert got[0] == peft_greedy(base, adapters["qv"].lora_path, prompts[0], NEW_TOKENS)
        assert got[1] == hf_greedy(base, prompts[1], NEW_TOKENS, ignore_eos=True)
        assert got[2] == peft_greedy(base, adapters["all"].lora_path, prompts[2], NEW_TOKENS)
        loads = engine.core.lora.num_disk_loads
        assert engine.unload_lora("qv")
        assert "qv" not in engine.core.lora.stats().in_cpu
        assert await run("qv", prompts[0], "d") == got[0]
        assert engine.core.lora.num_disk_loads == loads + 1
        assert engine.remove_lora("all")
        with pytest.raises(UnknownModel):
            engine.submit({"prompt_token_ids": prompts[2]}, greedy(), "e", model="all")


async def test_adapter_that_fails_to_load_later_fails_its_request_only(base, adapters, tmp_path):
    """An adapter registered fine, dropped from memory, then corrupted on disk: its next
    request fails with LoRAError (read on the worker thread), the base model keeps serving."""
    import shutil

    from lockgate.engine import AsyncEngine

    copy = tmp_path / "copy"
    shutil.copytree(adapters["qv"].lora_path, copy)
    prompt = random_prompts(base, [12], seed=17)[0]
    async with AsyncEngine(base, dtype="float32", enable_lora=True, num_kv_blocks=32) as engine:
        await engine.add_lora(LoRARequest("fragile", 40, str(copy)))
        engine.unload_lora("fragile")
        (copy / "adapter_model.safetensors").write_bytes(b"garbage")
        with pytest.raises(LoRAError, match="cannot be read"):
            async for _ in engine.generate({"prompt_token_ids": prompt}, greedy(), "x", model="fragile"):
                pass
        outs = [o async for o in engine.generate({"prompt_token_ids": prompt}, greedy(), "y")]
        assert outs[-1].outputs[0].token_ids == hf_greedy(base, prompt, NEW_TOKENS, ignore_eos=True)
        assert engine.core.lora.stats().requests == {} and engine.core.kv.num_used_blocks == 0


@pytest.mark.parametrize("method", [["--method", "awq", "--group-size", "32"],
                                    ["--method", "gptq", "--group-size", "32", "--asym", "--desc-act"]])
def test_lora_on_a_quantized_base_matches_peft_on_the_dequantized_model(base, method, tmp_path):
    """An adapter on an AWQ / GPTQ base (made by `lockgate quantize`) equals HF + peft on the
    dequantized weights, in a batch that mixes it with the bare quantized base."""
    quant_dir = tmp_path / "quant"
    run_quantize(base, str(quant_dir), *method)
    hf_dir = write_hf_twin(quant_dir, tmp_path / "hf", dequantize_checkpoint(quant_dir))
    adapter = write_demo_adapter(hf_dir, tmp_path / "adapter", rank=8, targets="q,v,o,down", seed=21)
    req = LoRARequest("on-quant", 50, str(adapter))
    prompts = random_prompts(str(hf_dir), [6, 19, 40], seed=22)
    llm = LLM(str(quant_dir), dtype="float32", enable_lora=True, num_kv_blocks=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(),
                        lora_request=[req, None, req], use_progress_bar=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want = (peft_greedy(str(hf_dir), str(adapter), prompt, NEW_TOKENS) if i != 1
                else hf_greedy(str(hf_dir), prompt, NEW_TOKENS, ignore_eos=True))
        assert out.outputs[0].token_ids == want, i
    assert outs[0].outputs[0].token_ids != hf_greedy(str(hf_dir), prompts[0], NEW_TOKENS, ignore_eos=True)


def test_llm_raises_when_an_evicted_adapter_cannot_be_read_again(base, adapters, tmp_path):
    """max_cpu_loras 1: reading adapter qv evicts the fragile copy read before; the copy, now
    corrupt on disk, is read again for its request and fails: generate raises LoRAError and
    leaves nothing behind."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapters["all"].lora_path, copy)
    fragile = LoRARequest("fragile", 60, str(copy))
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=32)
    llm.add_lora(fragile)
    (copy / "adapter_model.safetensors").write_bytes(b"garbage")
    prompt = {"prompt_token_ids": random_prompts(base, [10], seed=23)[0]}
    with pytest.raises(LoRAError, match="cannot be read"):
        # in prompt order: fragile is found in the cache, then reading qv evicts it
        llm.generate([prompt, prompt], greedy(), lora_request=[fragile, adapters["qv"]])
    assert not llm.engine.has_unfinished and llm.engine.kv.num_used_blocks == 0
    assert llm.engine.stats().lora.requests == {}
    out = llm.generate(prompt, greedy(), lora_request=adapters["qv"])[0]
    assert out.outputs[0].token_ids == peft_greedy(base, adapters["qv"].lora_path, prompt["prompt_token_ids"],
                                                   NEW_TOKENS)
