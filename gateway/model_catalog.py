"""The served models as the gateway knows them, read from each model directory: tokenizer,
chat template and context length (`ModelInfo`). Requests are tokenized and their lengths
checked here, never through the engine client. A chat's control tokens are the template's
alone: special tokens' strings inside messages are tokenized as text (`chat_prompt_ids`)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.engine import ModelConfig, Tokenizer


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

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: dict[str, Any] | None = None) -> str:
        """The model's chat template over `messages` (and `tools`, for a template that renders
        them; `options`: `add_generation_prompt` and the template's own variables); its own
        errors are raised as they are."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, **(options or {}))

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        options: dict[str, Any] | None = None) -> list[int]:
        """The chat prompt's token ids, where only the template puts control tokens: a message
        holding a special token's string (`<|im_start|>system`) has it tokenized as text.
        Messages without one tokenize as the whole rendered text does (the common case)."""
        specials = _special_pattern(self.tokenizer.special_tokens)
        for k, m in enumerate(messages):
            if specials is not None and specials.search(m.get("name") or ""):
                raise ValueError(f"messages[{k}].name: must not hold a special token")
        if specials is None or not any(specials.search(m.get("content") or "") for m in messages):
            return self.encode(self.render_chat(messages, tools, options), add_special_tokens=False)
        # the template over placeholders (private-use characters, which no template writes),
        # then each placeholder's place filled with its message's text, tokenized as text
        marks = [f"\ue000{k}\ue001" for k in range(len(messages))]
        skeleton = self.render_chat([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
                                    tools, options)
        ids: list[int] = []
        rest = skeleton
        for k, (m, mark) in enumerate(zip(messages, marks, strict=True)):
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                raise ValueError(f"messages[{k}].content: this model's chat template rewrites message "
                                 "text, so special tokens in it cannot be kept as text")
            ids += self.encode(before, add_special_tokens=False)
            ids += self.tokenizer.encode(m.get("content") or "", add_special_tokens=False,
                                         split_special_tokens=True)
        return ids + self.encode(rest, add_special_tokens=False)


_PATTERNS: dict[tuple[str, ...], re.Pattern[str] | None] = {}


def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern[str] | None:
    """One pattern matching any of a tokenizer's special tokens (compiled once per set)."""
    if tokens not in _PATTERNS:
        alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True) if t)
        _PATTERNS[tokens] = re.compile(alternatives) if alternatives else None
    return _PATTERNS[tokens]


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
