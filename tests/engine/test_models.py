"""Model loading: sharded checkpoints, dtypes, rope scaling against transformers' own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.models.rope import inv_frequencies
from tests.support.helpers import demo_model, hf_greedy, hf_model, random_prompts


def test_sharded_checkpoint_with_index_loads_the_same(tmp_path):
    d = demo_model("qwen2")
    out = tmp_path / "sharded"
    hf_model(d).save_pretrained(out, max_shard_size="60KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 2
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(d) / name, out / name)
    prompts = random_prompts(d, [30, 90], seed=8)
    outs = LLM(str(out)).generate([{"prompt_token_ids": p} for p in prompts],
                                  SamplingParams(max_tokens=10, temperature=0), use_progress_bar=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, 10) for p in prompts]


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    d = demo_model("llama")
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights.pop("model.layers.0.self_attn.k_proj.weight")
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights"):
        LLM(str(bad))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run(dtype):
    llm = LLM(demo_model("llama"), dtype=dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = llm.generate("hello world", SamplingParams(max_tokens=8, ignore_eos=True), use_progress_bar=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else {**scaling, "rope_theta": 10000.0}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params,
                      max_position_embeddings=4096)
    kind = params["rope_type"]
    if kind == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(inv_frequencies(64, 10000.0, scaling), want)


def test_step_inputs_built_through_an_array_equal_torch_tensor():
    """The runner builds a step's int64 inputs through array('q') (faster than
    torch.tensor on a list): the same values, its own memory, and empty lists work."""
    from lockgate.engine.model_runner import _i64

    cpu = torch.device("cpu")
    for values in ([], [0], [3, -1, 2**40, 7], list(range(5000))):
        got = _i64(values, cpu)
        assert got.dtype == torch.long and torch.equal(got, torch.tensor(values, dtype=torch.long))
    a, b = _i64([1, 2], cpu), _i64([1, 2], cpu)
    a[0] = 9
    assert b.tolist() == [1, 2]


def test_rope_rows_are_the_tables_rows_at_each_position():
    from lockgate.engine.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(8, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    pos = torch.tensor([5, 0, 63, 5])
    at = rope.at(pos)
    assert at.cos.shape == (4, 1, 8) and torch.equal(at.cos[:, 0], rope.cos[pos])
    assert torch.equal(at.sin[:, 0], rope.sin[pos])
