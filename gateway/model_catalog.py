"""The served models as the gateway knows them, read from each model directory: tokenizer,
chat template and context length (`ModelInfo`). Requests are tokenized and their lengths
checked here, never through the engine client."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import ModelConfig, Tokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One base model's directory, as the gateway uses it. `max_model_len`: the context a
    request may use, by the same rule as the engine's (the configured `max_model_len`, else
    the model's `max_position_embeddings`)."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The model's chat template over `messages`; its own errors are raised as they are."""
        return self.tokenizer.apply_chat_template(messages)


def read_model_info(name: str, path: str | Path, *, max_model_len: int | None = None) -> ModelInfo:
    """Read a model directory (blocking: the tokenizer, and the chat template's renderer so
    the first request does not wait for it)."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    context = config.context_length(max_model_len)
    tokenizer = Tokenizer(path)
    _ = tokenizer.hf_tokenizer   # load the chat template's renderer now
    return ModelInfo(name, path, config, tokenizer, context)


async def read_catalog(specs: Mapping[str, str | Path], *,
                       max_model_len: int | None = None) -> dict[str, ModelInfo]:
    """Every model of `specs` (name -> directory), read on worker threads."""
    infos = await asyncio.gather(*(asyncio.to_thread(read_model_info, name, path,
                                                     max_model_len=max_model_len)
                                   for name, path in specs.items()))
    return {info.name: info for info in infos}
