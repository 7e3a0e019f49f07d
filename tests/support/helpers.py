"""Helpers shared by the tests: demo models written offline, HF transformers as the oracle."""

from __future__ import annotations

import atexit
import copy
import shutil
import tempfile
from functools import cache, lru_cache
from pathlib import Path

import torch

from lockgate.engine.demo_model import write_demo_model

FAMILIES = ("llama", "qwen2", "mistral")


@lru_cache(maxsize=1)
def _model_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="lockgate-test-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@cache
def demo_model(family: str = "llama", size: str = "tiny", seed: int = 0) -> str:
    """A demo model directory, written once per test session."""
    path = _model_root() / f"{family}-{size}-{seed}"
    write_demo_model(path, family=family, size=size, seed=seed)
    return str(path)


@cache
def copy_model(draft: bool = False) -> str:
    """The copy demo model (engine/spec/copy_model.py: greedy output quotes the prompt), or
    its draft, written once per test session."""
    from lockgate.engine import write_copy_model

    path = _model_root() / ("copy-draft" if draft else "copy")
    write_copy_model(path, draft=draft)
    return str(path)


def special_ids(model_dir: str) -> set[int]:
    from lockgate.engine.config import ModelConfig
    from lockgate.engine.tokenizer import Tokenizer

    return Tokenizer(model_dir).special_token_ids | set(ModelConfig.from_dir(model_dir).eos_token_ids)


def random_prompts(model_dir: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    from lockgate.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    allowed = torch.tensor(sorted(set(range(vocab)) - special_ids(model_dir)))
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist() for n in lengths]


# 18 prompts of 1 to 300 tokens, around block edges on purpose
PROMPT_LENS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 64, 100, 129, 200, 255, 256, 257, 299, 300]
MAX_TOKENS = [5, 17, 32, 9, 24, 1, 40, 12, 33, 20, 7, 28, 16, 3, 36, 11, 25, 30]


@cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """HF transformers' greedy continuation of one prompt: the oracle."""
    return list(_hf_greedy(model_dir, tuple(prompt), max_tokens, ignore_eos))


@cache
def _hf_greedy(model_dir: str, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
    model = hf_model(model_dir)
    ids = torch.tensor([prompt])
    kwargs = {"min_new_tokens": max_tokens} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    return tuple(out[0, len(prompt):].tolist())


def assert_all_blocks_free(core) -> None:
    core.verify()
    assert core.kv.num_used_blocks == 0, f"{core.kv.num_used_blocks} blocks still held"
    assert not core.scheduler.running and not core.scheduler.waiting


@cache
def hf_model_f64(model_dir: str):
    return copy.deepcopy(hf_model(model_dir)).to(torch.float64)   # hf_model's own stays float32


NEAR_TIE = 1e-3     # a float64 top-two gap below this is a coin toss for float32 arithmetic


def judge_greedy(model_dir: str, prompts: list[list[int]], got: list[list[int]], max_tokens: list[int],
                 *, max_ties: int = 2, label: str = "") -> list[str]:
    """Greedy outputs checked against HF transformers in float64, teacher-forced: one forward
    over prompt + output gives HF's greedy choice after every prefix of the output at once.
    An output is HF's greedy continuation iff each of its tokens is HF's top-1 after the
    tokens before it (and it stops at max_tokens or an EOS). A request may differ only where
    HF's float64 top-two gap at its first difference is below NEAR_TIE, at most `max_ties`
    of them per run, each printed. Raises AssertionError listing the others; returns the ties."""
    from lockgate.engine.config import ModelConfig

    model = hf_model_f64(model_dir)
    eos = set(ModelConfig.from_dir(model_dir).eos_token_ids)
    ties, decisive = [], []
    for i, (p, g, m) in enumerate(zip(prompts, got, max_tokens, strict=True)):
        if len(g) != m and not (g and g[-1] in eos):
            decisive.append(f"{label} request {i}: stopped after {len(g)} of {m} tokens without an EOS")
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([p + g[:-1]])).logits[0, len(p) - 1:]
        top = torch.topk(logits, 2, dim=-1)
        wrong = (top.indices[:, 0] != torch.tensor(g)).nonzero()
        if not len(wrong):
            continue
        t = int(wrong[0])
        gap = float(top.values[t, 0] - top.values[t, 1])
        line = (f"{label} request {i}: first difference at token {t} (got {g[t]}, HF {int(top.indices[t, 0])}), "
                f"HF float64 top-two gap {gap:.2e}")
        (ties if gap < NEAR_TIE else decisive).append(line)
    for line in ties:
        print("near tie:", line)
    assert not decisive, "outputs differ from HF where it is decisive:\n" + "\n".join(decisive)
    assert len(ties) <= max_ties, f"{len(ties)} near ties, more than {max_ties}:\n" + "\n".join(ties)
    return ties
