"""Quantized checkpoints for the tests: `lockgate quantize` run in-process, the float twin of a
checkpoint (dequantized with kernels/quant's reference) for HF transformers, and the greedy
comparison against it. Shared by test_quant.py, test_quant_fixtures.py, test_model_pool.py and
test_lora_engine.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from lockgate.engine import LLM, SamplingParams
from lockgate.gateway.cli import app
from lockgate.kernels.quant import awq_dequantize, gptq_dequantize
from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, random_prompts

PROMPT_LENS = [1, 7, 16, 33, 64, 129, 200, 300]
MAX_TOKENS = [12, 16, 9, 16, 5, 16, 11, 16]
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


# -- a checkpoint's float twin and the greedy comparison ------------------------------------------
def copy_tokenizer(family: str, dst: Path) -> None:
    """Tokenizer and generation files of the demo model of `family` (byte-identical per family)."""
    for f in Path(demo_model(family)).iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)


def write_hf_twin(quant_dir: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> Path:
    """A full-precision model directory: quant_dir's config minus quantization_config, its
    unquantized tensors (as float32), and `dequantized` HF weights [out, in] (+ biases)."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((quant_dir / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    for f in quant_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    packed = load_file(str(quant_dir / "model.safetensors"))
    state = {k: v.float() for k, v in packed.items() if k.rpartition(".")[2] not in QUANT_SUFFIXES}
    state.update({k: v.float() for k, v in dequantized.items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def assert_greedy_matches_hf(quant_dir: Path, hf_dir: Path, seed: int = 1) -> LLM:
    """Several prompts of 1-300 tokens, greedy, one generate call: token for token equal."""
    prompts = random_prompts(str(hf_dir), PROMPT_LENS, seed=seed)
    want = [hf_greedy(str(hf_dir), p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    assert len({tuple(w) for w in want}) == len(want), "continuations should differ"
    llm = LLM(model=str(quant_dir), dtype="float32", block_size=16)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert_all_blocks_free(llm.engine)
    return llm


# -- checkpoints written by `lockgate quantize` ----------------------------------------------------
def dequantize_checkpoint(quant_dir: Path) -> dict[str, torch.Tensor]:
    """HF weights [out, in] of every quantized layer, through kernels/quant's reference."""
    q = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    t = load_file(str(quant_dir / "model.safetensors"))
    out = {}
    for name in t:
        if name.endswith(".qweight"):
            layer = name.removesuffix(".qweight")
            scales = t[f"{layer}.scales"].float()
            if q["quant_method"] == "awq":
                w = awq_dequantize(t[name], t[f"{layer}.qzeros"], scales, q["group_size"])
            else:
                w = gptq_dequantize(t[name], t[f"{layer}.qzeros"], scales, t[f"{layer}.g_idx"], q["bits"])
            out[f"{layer}.weight"] = w.t()
    return out


def run_quantize(*args: str) -> None:
    result = CliRunner().invoke(app, ["quantize", *args])
    assert result.exit_code == 0, result.output
