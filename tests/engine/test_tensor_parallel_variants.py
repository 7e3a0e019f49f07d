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

from lockgate.engine import LLM, SamplingParams
from tests.support.helpers import MAX_TOKENS, PROMPT_LENS, judge_greedy, random_prompts
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
