"""lockgate.engine.lora_demo.write_demo_adapter: a PEFT adapter that loads, changes greedy output and is
byte-deterministic."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from lockgate.engine.lora_demo import parse_targets, write_demo_adapter
from tests.support.helpers import demo_model, hf_greedy, hf_model, random_prompts

FILES = ("adapter_config.json", "adapter_model.safetensors")
NEW_TOKENS = 8


def digests(path: Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def base() -> str:
    return demo_model("llama", "tiny", 0)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    return write_demo_adapter(base, tmp_path_factory.mktemp("adapter") / "a", rank=8, seed=0)


def test_files_and_config(adapter):
    for f in FILES:
        assert (adapter / f).is_file()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert cfg["target_modules"] == ["q_proj", "v_proj"]


def test_peft_loads_and_changes_greedy_output(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(base, [1, 3, 8, 12, 20, 31, 45, 64, 90, 128], seed=7)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(model, str(adapter), local_files_only=True).eval()
    # the loaded B matrices are the non-zero ones that were written
    bs = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert bs and all(p.abs().max() > 0 for p in bs)
    changed = 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            lora = out[0, len(prompt):].tolist()
            assert len(lora) == NEW_TOKENS
            changed += lora != hf_greedy(base, prompt, NEW_TOKENS)
    assert changed >= 8, f"the adapter changed only {changed}/10 greedy continuations"
    # the base model is untouched by wrapping a fresh copy
    assert not any("lora" in n for n, _ in hf_model(base).named_parameters())


def test_same_seed_same_bytes_other_seed_differs(base, adapter, tmp_path):
    again = write_demo_adapter(base, tmp_path / "again", rank=8, seed=0)
    assert digests(again) == digests(adapter)
    other = write_demo_adapter(base, tmp_path / "other", rank=8, seed=1)
    d_other = digests(other)
    assert d_other["adapter_model.safetensors"] != digests(adapter)["adapter_model.safetensors"]
    assert d_other["adapter_config.json"] == digests(adapter)["adapter_config.json"]  # seed is weights only


def test_global_rng_untouched(base, tmp_path):
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    write_demo_adapter(base, tmp_path / "a", rank=2, targets="q", seed=0)
    assert torch.equal(torch.rand(4), want)


def test_parse_targets():
    assert parse_targets("q,v") == ("q_proj", "v_proj")
    assert parse_targets(["gate", "up_proj", "down", "gate_proj"]) == ("gate_proj", "up_proj", "down_proj")


def test_invalid_arguments(base, tmp_path):
    with pytest.raises(ValueError, match="targets"):
        write_demo_adapter(base, tmp_path / "a", targets=("q", "attn"))
    with pytest.raises(ValueError, match="targets"):
        write_demo_adapter(base, tmp_path / "a", targets=())
    with pytest.raises(ValueError, match="rank"):
        write_demo_adapter(base, tmp_path / "a", rank=0)
    assert not (tmp_path / "a").exists()
