"""The copy demo models (engine/spec/copy_model.py): hand-set Llama weights whose greedy
output quotes the prompt, in our engine as in HF transformers, and a smaller draft that
predicts what the target will quote."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib
from pathlib import Path

import pytest
import torch

from lockgate.engine import LLM, SamplingParams, write_copy_model
from lockgate.engine.demo_tokenizer import _corpus
from lockgate.engine.spec.copy_model import build_copy_config
from tests.support.helpers import hf_greedy

pytest.importorskip("transformers")

QUOTE_FROM = 6        # the prompt repeats the source's first 6 tokens, then the model goes on
NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy")
    return str(write_copy_model(root / "target")), str(write_copy_model(root / "draft", draft=True))


def _source(llm: LLM, first_sentence: int) -> list[int]:
    """Four sentences of the demo tokenizer's pseudo-word text, as token ids."""
    return llm.tokenizer.encode(" ".join(_corpus()[first_sentence:first_sentence + 4]))


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_quotes_the_span_in_our_engine_as_in_hf(models):
    """A source, then its first tokens again: greedy goes on quoting the source (every token
    of it, 24 of them), and HF transformers' greedy gives the same tokens."""
    target, _ = models
    llm = LLM(target)
    g = torch.Generator().manual_seed(0)
    random_span = torch.randint(3, 512, (60,), generator=g).tolist()
    sources = [_source(llm, 0), _source(llm, 20), random_span]
    prompts = [src + src[:QUOTE_FROM] for src in sources]
    outs = _greedy(llm, prompts, NEW_TOKENS)
    for src, prompt, out in zip(sources, prompts, outs, strict=True):
        assert out == src[QUOTE_FROM:QUOTE_FROM + NEW_TOKENS], (src, out)
        assert out == hf_greedy(target, prompt, NEW_TOKENS, ignore_eos=True)


def test_draft_predicts_what_the_target_quotes(models):
    """The draft, teacher-forced on the target's greedy quote of a source (our engine, one
    token after each prefix), agrees with the target on at least 70% of the positions."""
    target, draft = models
    target_llm = LLM(target)
    src = _source(target_llm, 40)
    prompt = src + src[:QUOTE_FROM]
    quoted = _greedy(target_llm, [prompt], NEW_TOKENS)[0]
    predicted = _greedy(LLM(draft), [prompt + quoted[:i] for i in range(NEW_TOKENS)], 1)
    agree = sum(p == [t] for p, t in zip(predicted, quoted, strict=True)) / NEW_TOKENS
    print(f"\ndraft agrees with the target on {agree:.0%} of {NEW_TOKENS} quoted tokens")
    assert agree >= 0.7


def test_the_draft_is_smaller_and_the_files_are_deterministic(models, tmp_path):
    target, draft = models
    t, d = build_copy_config(), build_copy_config(draft=True)
    assert d["vocab_size"] == t["vocab_size"] and d["hidden_size"] < t["hidden_size"]
    assert d["num_attention_heads"] < t["num_attention_heads"]

    def digest(path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    again = write_copy_model(tmp_path / "again")
    assert digest(again) == digest(Path(target))
    assert (again / "tokenizer.json").read_text() == (Path(draft) / "tokenizer.json").read_text()
    assert digest(write_copy_model(tmp_path / "seed1", seed=1)) != digest(again)
    with pytest.raises(ValueError, match="size"):
        write_copy_model(tmp_path / "bad", size="tiny-mqa")


def test_demo_model_command_writes_the_copy_models(models, tmp_path):
    from typer.testing import CliRunner

    from lockgate.gateway.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["demo-model", str(tmp_path / "d"), "--copy", "--draft"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == (Path(models[1]) / "model.safetensors").read_bytes()
    out = runner.invoke(app, ["demo-model", str(tmp_path / "q"), "--copy", "--family", "qwen2"])
    assert out.exit_code != 0 and "--family" in out.output
