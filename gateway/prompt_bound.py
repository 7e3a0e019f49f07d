"""The fewest tokens a prompt can possibly become, known without tokenizing it, so one that can
never fit the model's context is refused before it costs a tokenizer worker a second.

The bound is the prompt's UTF-8 bytes over the most input bytes one token can stand for.
That is only safe where every input byte is carried into some token, so it is computed once
per tokenizer from its pipeline and given only where the pipeline is known to keep them:

- model BPE, with no unknown token or none fused (a fused one swallows any run of unknown
  characters): every byte lands in a token of the vocabulary (byte-level alphabets, byte
  fallback) or is one unknown token for each character;
- pre-tokenizers that only split or map (ByteLevel, Metaspace, Split without "removed",
  Digits, Punctuation, UnicodeScripts); Whitespace, BertPreTokenizer and their like drop text;
- normalizers that cannot shrink text by more than `UNICODE_SHRINK` (NFC, NFKC, NFD, NFKD,
  Lowercase: Hangul jamo composing into one syllable, 9 bytes into 3, is the worst), or that
  only grow it (Prepend, a plain Replace by something at least as long); Strip, accents
  stripped and Precompiled maps (SentencePiece's, which may map characters to nothing) drop
  text: no bound for them;
- no truncation configured (it would cut the count).

The most bytes one token stands for: the longest token's text in UTF-8, added tokens'
content included. A byte-level token's characters stand for one byte each and are 1 or 2
bytes in UTF-8, Metaspace's "▁" stands for a space in 3 bytes, a byte-fallback token
"<0x41>" for one byte in 6: each over-counts, which only weakens the bound.

A chat's tokens are the rendered template's: of its messages only the users' text is counted
(stripped: templates often trim), and only where the model's template was seen to render
each user message's text (a probe chat, once per model).
"""

from __future__ import annotations

import json
import logging
import math
import weakref
from typing import Any

from lockgate.engine import Tokenizer

logger = logging.getLogger(__name__)

UNICODE_SHRINK = 4          # NFC/NFKC and lowercasing shrink UTF-8 text at most 3x; a margin
_UNICODE = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_PROBE = ("\ue010lockgate-probe-1\ue011", "\ue010lockgate-probe-2\ue011")

_BYTES_PER_TOKEN: weakref.WeakKeyDictionary[Tokenizer, float | None] = weakref.WeakKeyDictionary()
_CHAT_KEEPS_USERS: weakref.WeakKeyDictionary[Tokenizer, bool] = weakref.WeakKeyDictionary()


def _normalizer_shrink(spec: dict[str, Any] | None) -> float | None:
    """How many times the normalizer may shrink UTF-8 text at most; None: unbounded."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind in _UNICODE:
        return UNICODE_SHRINK
    if kind == "Prepend":
        return 1.0
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content") or ""
        if pattern and len(content.encode()) >= len(pattern.encode()):
            return 1.0
    return None


def _keeps_every_byte(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(pre.get("behavior", "Isolated")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def bytes_per_token(tokenizer: Tokenizer) -> float | None:
    """The most bytes of input one token can stand for (normalizing included), or None where
    the tokenizer's pipeline might drop text (then no bound is given). Computed once."""
    if tokenizer in _BYTES_PER_TOKEN:
        return _BYTES_PER_TOKEN[tokenizer]
    try:
        value = _compute(tokenizer)
    except Exception:  # a pipeline this cannot read gets no bound, never an error
        logger.warning("no prompt length bound for this tokenizer", exc_info=True)
        value = None
    _BYTES_PER_TOKEN[tokenizer] = value
    return value


def _compute(tokenizer: Tokenizer) -> float | None:
    spec = json.loads((tokenizer.model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    added = [a.get("content") or "" for a in spec.get("added_tokens") or []]
    longest = max(len(t.encode("utf-8", "surrogatepass")) for t in [*vocab, *added, "1234"])
    return float(longest * shrink)       # "1234": an unknown character is one token, 4 bytes


def known(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's bounds are computed (else `learn` them, off the loop)."""
    return tokenizer in _BYTES_PER_TOKEN and tokenizer in _CHAT_KEEPS_USERS


def learn(tokenizer: Tokenizer) -> None:
    """Compute the tokenizer's bounds (blocking: reads tokenizer.json, renders the probe)."""
    bytes_per_token(tokenizer)
    _template_keeps_users(tokenizer)


def min_tokens(tokenizer: Tokenizer, text: str) -> int:
    """At least this many tokens `text` becomes (0 where no bound is known)."""
    per_token = bytes_per_token(tokenizer)
    if per_token is None:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / per_token)


def _template_keeps_users(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders each user message's text as it is (probed once)."""
    if tokenizer not in _CHAT_KEEPS_USERS:
        probe = [{"role": "user", "content": _PROBE[0]}, {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": _PROBE[1]}]
        try:
            text = tokenizer.apply_chat_template(probe)
            keeps = all(text.count(mark) == 1 for mark in _PROBE)
        except Exception:  # noqa: BLE001 - a template that refuses the probe gets no bound
            keeps = False
        _CHAT_KEEPS_USERS[tokenizer] = keeps
    return _CHAT_KEEPS_USERS[tokenizer]


def min_chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> int:
    """At least this many tokens the chat's rendered prompt becomes (0: no bound known)."""
    if bytes_per_token(tokenizer) is None or not _template_keeps_users(tokenizer):
        return 0
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return min_tokens(tokenizer, "".join(c.strip() for c in users if isinstance(c, str)))
