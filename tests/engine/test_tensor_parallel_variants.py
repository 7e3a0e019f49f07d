"""Variants under tensor parallelism: AWQ and GPTQ (desc_act) checkpoints cut along their
packed layouts give, at tensor_parallel_size=2, the greedy output of one rank; a group size
a rank's slice does not divide is refused at start, by layer, sizes and the TP size that
fits; batched multi-LoRA at N=2 equals HF + peft running each adapter alone.

Each rank group is started once for the module (a spawn costs seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockgate.engine import LLM, LoRARequest, SamplingParams
from lockgate.engine.lora_demo import write_demo_adapter
from tests.support.helpers import MAX_TOKENS, PROMPT_LENS, demo_model, hf_greedy, judge_greedy, random_prompts
from tests.support.lora import peft_greedy
from tests.support.quant import copy_tokenizer, write_hf_twin

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
QUANT_MODELS = ("awq_g32_llama", "gptq_4bit_asym_descact_g32_qwen2")
ENGINE_KW = {"dtype": "float32", "block_size": 16, "num_threads": 1}


def _quant_dirs(name: str, root: Path) -> tuple[Path, Path]:
    """The packed checkpoint (with its tokenizer) and its HF twin on the packer's floats."""
    case = MANIFEST["cases"][name]
    src = FIXTURES / case["dir"]
    quant_dir = root / name
    quant_dir.mkdir()
    for f in ("config.json", "model.safetensors"):
        (quant_dir / f).write_bytes((src / f).read_bytes())
    copy_tokenizer(case["family"], quant_dir)
    hf_dir = write_hf_twin(quant_dir, root / f"{name}-hf", load_file(str(src / "dequantized.safetensors")))
    return quant_dir, hf_dir


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("quant")
    return {name: _quant_dirs(name, root) for name in QUANT_MODELS}


@pytest.mark.parametrize("name", QUANT_MODELS)
def test_quantized_checkpoint_at_two_ranks_matches_one_rank(name, quant_dirs):
    """18 prompts of 1-300 tokens: N=2 gives N=1's greedy tokens (HF's on the packer's floats,
    near ties excepted), each rank holding half the packed words, groups and g_idx."""
    quant_dir, hf_dir = quant_dirs[name]
    prompts = random_prompts(str(hf_dir), PROMPT_LENS, seed=1)
    got1 = _generate(LLM(str(quant_dir), **ENGINE_KW), prompts, MAX_TOKENS)
    two = LLM(str(quant_dir), tensor_parallel_size=2, **ENGINE_KW)
    try:
        got2 = _generate(two, prompts, MAX_TOKENS)
        model = two.engine.runner.model
        o_proj = model.layers[0].self_attn.o_proj
        full_in = json.loads((quant_dir / "config.json").read_text())["hidden_size"]
        assert o_proj.in_features == full_in // 2
        if name.startswith("gptq"):
            # desc_act: a rank's input rows belong to any group; every group is kept
            assert o_proj.g_idx.shape == (1, full_in // 2) and o_proj.scales.shape[0] == full_in // 32
            assert sorted(o_proj.g_idx[0].tolist()) != o_proj.g_idx[0].tolist()
        else:
            assert o_proj.qweight.shape[0] == full_in // 2 and o_proj.scales.shape[0] == full_in // 2 // 32
    finally:
        two.engine.shutdown()
    ties = judge_greedy(str(hf_dir), prompts, got2, MAX_TOKENS, label=f"{name} N=2")
    assert sum(a != b for a, b in zip(got1, got2, strict=True)) <= len(ties)


def test_misaligned_awq_group_size_is_refused_at_start(quant_dirs):
    """AWQ groups of 32 input rows: o_proj's 64 inputs cut 4 ways leave 16 a rank. Refused
    before any rank is spawned, naming the layer, the sizes and the TP size that fits."""
    quant_dir, _ = quant_dirs["awq_g32_llama"]
    with pytest.raises(ValueError) as err:
        LLM(str(quant_dir), tensor_parallel_size=4, **ENGINE_KW)
    msg = str(err.value)
    assert "self_attn.o_proj" in msg and "16 (64 / 4)" in msg and "group_size 32" in msg
    assert msg.endswith("the largest tensor_parallel_size that fits is 2")
    assert not torch.distributed.is_initialized()


# rank, targets, seed: column-parallel (q, k, v, gate, up) and row-parallel (o, down) layers,
# ranks zero-padded to max_lora_rank in one slot tensor
ADAPTERS = {
    "qv": (8, "q,v", 1),
    "all": (4, "q,k,v,o,gate,up,down", 2),
    "mlp": (16, "gate,up,down", 3),
    "ko": (2, "k,o", 4),
    "qd": (6, "q,down", 5),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lora_base() -> str:
    return demo_model("llama", "tiny", 0)


@pytest.fixture(scope="module")
def adapters(lora_base, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i, str(write_demo_adapter(lora_base, root / name, rank=r, targets=t, seed=seed)))
            for i, (name, (r, t, seed)) in enumerate(ADAPTERS.items(), start=1)}


@pytest.fixture(scope="module")
def lora_tp(lora_base):
    llm = LLM(lora_base, tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_batched_tokens=64, num_kv_blocks=64, dtype="float32", num_threads=1)
    yield llm
    llm.engine.shutdown()


def _lora_generate(llm: LLM, names: list[str | None], prompts: list[list[int]], adapters) -> list[list[int]]:
    loras = [adapters[n] if n else None for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        lora_request=loras, use_progress_bar=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_multi_lora_batch_at_two_ranks_matches_peft(lora_base, adapters, lora_tp):
    """Three adapters and the base model interleaved in one batch (chunked prefill in it),
    each rank holding its cut of every slot; every output equals HF + peft running its
    adapter alone."""
    names = ["qv", None, "all", "mlp", None, "qv", "all", "mlp"]
    prompts = random_prompts(lora_base, [5, 17, 33, 9, 64, 40, 3, 100], seed=11)
    got = _lora_generate(lora_tp, names, prompts, adapters)
    changed = 0
    for name, prompt, out in zip(names, prompts, got, strict=True):
        want = peft_greedy(lora_base, adapters[name].lora_path if name else None, prompt, NEW_TOKENS)
        assert out == want, f"adapter {name}"
        changed += bool(name) and want != hf_greedy(lora_base, prompt, NEW_TOKENS, ignore_eos=True)
    assert changed >= 4, "the adapters should change most continuations, or the test proves little"
    # the other rank really holds its cut: half of a row-parallel layer's A, half of a column one's B
    model = lora_tp.engine.runner.model
    slots = model.layers[0].self_attn.o_proj.lora
    assert slots is not None and slots.lora_a.shape[-1] == model.cfg.hidden_size // 2
    stats = lora_tp.engine.stats().lora
    assert stats.slot_loads == 3 and stats.disk_loads == 3
    assert lora_tp.engine.kv.num_used_blocks == 0


def test_adapters_registered_later_reach_every_rank(lora_base, adapters, lora_tp):
    """Adapters first seen now (k+o, q+down) take the slots of earlier ones; one removed and
    read again: each rank's slots follow rank 0's, every output equals peft."""
    names = ["ko", "qd", None, "ko", "all"]
    prompts = random_prompts(lora_base, [12, 30, 7, 50, 21], seed=12)
    got = _lora_generate(lora_tp, names, prompts, adapters)
    assert lora_tp.engine.lora.remove(adapters["ko"].lora_int_id)
    got += _lora_generate(lora_tp, ["ko", "qv"], prompts[:2], adapters)
    for name, prompt, out in zip([*names, "ko", "qv"], [*prompts, *prompts[:2]], got, strict=True):
        want = peft_greedy(lora_base, adapters[name].lora_path if name else None, prompt, NEW_TOKENS)
        assert out == want, f"adapter {name}"
    assert lora_tp.engine.stats().lora.disk_loads >= 6
