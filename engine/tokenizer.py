"""The model's tokenizer, from its tokenizer.json (the `tokenizers` library does the work).

Chat templates are rendered by transformers' own tokenizer class, loaded only when first
needed, so the engine starts without importing transformers.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: {self.model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = self.model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        specials = {i: tok.content for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        self.special_token_ids = set(specials)
        self.special_tokens = tuple(sorted(specials.values()))

    @property
    def chat_template(self) -> str | None:
        return self.config.get("chat_template")

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """`split_special_tokens`: special tokens' strings in `text` are read as plain text."""
        tok = self._plain_text_tok if split_special_tokens else self._tok
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _plain_text_tok(self) -> HFTokenizer:
        # a copy with the switch on (it is the tokenizer's own state: never toggled on the
        # shared one, which other threads may be using)
        tok = HFTokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        tok.encode_special_tokens = True
        return tok

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (as the tokenizer stores it: byte-level, not text)."""
        return self._tok.id_to_token(token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True, context: list[int] | None = None) -> DecodeStream:
        """A fresh incremental detokenizer; `context` (the prompt's last tokens) is decoded
        as the start but not emitted."""
        if context:
            return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step_stream(self, stream: DecodeStream, token_id: int) -> str:
        """Feed one token; returns the text it completes ('' while a character is partial)."""
        return stream.step(self._tok, token_id) or ""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def hf_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    @property
    def template_renders_tools(self) -> bool:
        """Does the chat template render a `tools` list (HF's `tools=`)? Else callers put the
        tools in a message themselves."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The template over `messages`; `variables`: the template's own (`enable_thinking`...)."""
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template")
        return self.hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools or None, **variables
        )
