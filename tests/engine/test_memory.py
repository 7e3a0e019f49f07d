"""The memory budget that sizes the KV cache (and later LoRA slots and more models)."""

from __future__ import annotations

import pytest
import torch

from lockgate.engine import LLM
from lockgate.engine.memory import CPU_DEFAULT_KV_BYTES, MemoryBudget
from tests.support.helpers import demo_model


def test_budget_reserves_and_sizes_the_cache_from_what_is_left():
    b = MemoryBudget.for_device(torch.device("cpu"), gpu_memory_utilization=0.9,
                                kv_cache_memory=None, weight_bytes=1000)
    assert b.total_bytes == 1000 + CPU_DEFAULT_KV_BYTES
    b.reserve("lora_slots", 4096)                       # a share reserved before the cache is sized
    blocks = b.kv_blocks(8192, num_kv_blocks=None, kv_cache_memory=None)
    assert blocks == (CPU_DEFAULT_KV_BYTES - 4096) // 8192
    assert b.available_bytes < 8192
    with pytest.raises(MemoryError, match="lora_more"):
        b.reserve("lora_more", 8192)
    assert b.release("lora_slots") == 4096 and b.available_bytes >= 4096
    assert b.summary()["kv_cache_bytes"] == blocks * 8192


def test_explicit_sizes_win():
    b = MemoryBudget.for_device(torch.device("cpu"), gpu_memory_utilization=0.9,
                                kv_cache_memory=10 * 8192, weight_bytes=0)
    assert b.kv_blocks(8192, num_kv_blocks=None, kv_cache_memory=10 * 8192) == 10
    b = MemoryBudget.for_device(torch.device("cpu"), gpu_memory_utilization=0.9,
                                kv_cache_memory=None, weight_bytes=0)
    assert b.kv_blocks(8192, num_kv_blocks=100_000, kv_cache_memory=None) == 100_000   # grows past the default


def test_engine_default_cache_is_512_mib_on_cpu():
    llm = LLM(demo_model("llama"))
    core = llm.engine
    per_block = core.runner.bytes_per_block(core.config.block_size)
    assert core.num_kv_blocks == CPU_DEFAULT_KV_BYTES // per_block
    assert core.stats().memory["weights_bytes"] == core.runner.weight_bytes


def test_chat_template_renders_from_the_tokenizer_config():
    from lockgate.engine.tokenizer import Tokenizer

    tok = Tokenizer(demo_model("qwen2"))
    text = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert "hi there" in text and text.endswith("assistant\n")
