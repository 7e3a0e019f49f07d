"""HF transformers + peft as the oracle for LoRA adapters: greedy tokens of a base model with one
adapter applied (or none). Shared by tests/engine/test_lora_engine.py and
tests/gateway/test_gateway_adapters.py."""

from __future__ import annotations

from functools import cache

import torch

from tests.support.helpers import hf_greedy


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
