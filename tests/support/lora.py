"""HF transformers + peft as the oracle for LoRA adapters: greedy tokens of a base model with one
adapter applied (or none). Shared by tests/engine/test_lora_engine.py and the gateway's adapter
tests (tests/gateway/test_gateway_adapters.py, test_gateway_replicas.py), which also share the
demo adapters below and the answer each must give."""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

from tests.support.helpers import demo_model, hf_greedy

# the gateway's adapter tests: a chat of NEW_TOKENS greedy tokens on the tiny llama
MAX_LORA_RANK = 8
NEW_TOKENS = 10
MESSAGES = [{"role": "user", "content": "Tell me about paging."}]
# name -> (base, rank, targets, seed)
SOURCES = {
    "pub": (("llama", "tiny", 0), 8, "q,v", 1),
    "own": (("llama", "tiny", 0), 4, "q,k,v,o,gate,up,down", 2),
    "big": (("llama", "tiny", 0), 16, "q,v", 3),          # rank over MAX_LORA_RANK
    "foreign": (("llama", "small", 0), 4, "q,v", 4),      # another base model's shapes
}


@cache
def _peft_model(base: str, path: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    return PeftModel.from_pretrained(model, path, local_files_only=True).eval()


def peft_greedy(base: str, path: str | None, prompt: list[int], n: int) -> list[int]:
    if path is None:
        return hf_greedy(base, prompt, n, ignore_eos=True)
    model = _peft_model(base, path)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@cache
def source(name: str) -> Path:
    """A demo adapter of SOURCES, written once per session outside any adapter root."""
    from lockgate.engine.lora_demo import write_demo_adapter

    (family, size, seed), rank, targets, aseed = SOURCES[name]
    out = Path(tempfile.mkdtemp(prefix="lockgate-test-adapters-")) / name
    return write_demo_adapter(demo_model(family, size, seed), out, rank=rank, targets=targets,
                              seed=aseed)


def install(root: Path, name: str, as_: str | None = None) -> str:
    """Copy a demo adapter into `root`; its path relative to the root."""
    dst = root / (as_ or name)
    if not dst.exists():
        shutil.copytree(source(name), dst)
    return dst.name


def prompt_ids() -> list[int]:
    from lockgate.engine.tokenizer import Tokenizer

    tok = Tokenizer(demo_model("llama", "tiny", 0))
    return tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)


def expected_text(adapter: str | None) -> str:
    """HF transformers (+ peft with the adapter): the greedy continuation of MESSAGES, decoded."""
    from lockgate.engine.tokenizer import Tokenizer

    base = demo_model("llama", "tiny", 0)
    ids = (peft_greedy(base, str(source(adapter)), prompt_ids(), NEW_TOKENS) if adapter
           else hf_greedy(base, prompt_ids(), NEW_TOKENS, ignore_eos=True))
    return Tokenizer(base).decode(ids)
