"""The demo models' tokenizer (engine/demo_model.py): a byte-level BPE trained with
`tokenizers` on a synthetic, seed-independent corpus, its tokenizer_config.json (with a
ChatML template) and special_tokens_map.json."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2  # the BPE trainer puts the special tokens first

# ChatML. `content` is normally a string; a list of {"type": "text", "text": ...} parts is joined.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)




_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "cl", "dr", "fl", "gr", "kr", "pl", "qu", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ie")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "nd", "st", "ck", "ng", "x", "rt")
_EXOTIC = ("café", "naïve", "Zürich", "straße", "façade", "smörgåsbord", "crème brûlée",
           "São Paulo", "Ελληνικά", "Привет", "мир", "中文", "日本語", "東京", "北京欢迎你", "한국어",
           "안녕하세요", "こんにちは", "🙂", "🚀", "👍🏽", "🎉", "❤️", "→", "≤", "∑", "€", "£", "½",
           "مرحبا", "שלום", "हिन्दी")
_PUNCT = (".", ",", "!", "?", ";", ":", "-", "...", "'s", "(", ")", '"', "/", "%", "&", "#", "@",
          "*", "+", "=")
_PRETOKENIZE_REGEX = (  # transformers' qwen2 PRETOKENIZE_REGEX
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CORPUS_SEED = 20240607  # the corpus never depends on the model seed
_CORPUS_LEXICON = 8000
_CORPUS_SENTENCES = 4000


@lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    """Synthetic training text: Zipf-distributed pseudo-words built from syllables, with
    capitals, digits, punctuation, newlines and some accented / CJK / emoji strings."""
    rng = random.Random(_CORPUS_SEED)  # noqa: S311 - a seeded, reproducible corpus, not a secret
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < _CORPUS_LEXICON:
        k = rng.choice((1, 2, 2, 2, 3, 3, 3, 4, 4, 5))
        w = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(k)
        )
        if w not in seen:
            seen.add(w)
            lexicon.append(w)
    cum = list(itertools.accumulate(1.0 / (r + 2.7) ** 1.07 for r in range(len(lexicon))))
    out = []
    for _ in range(_CORPUS_SENTENCES):
        words = rng.choices(lexicon, cum_weights=cum, k=rng.randint(4, 18))
        parts = []
        for i, w in enumerate(words):
            x = rng.random()
            if i == 0 or x < 0.05:
                w = w.capitalize()
            if x > 0.97:
                w = str(rng.randint(0, 99999))
            elif x > 0.94:
                w = rng.choice(_EXOTIC)
            elif x > 0.92:
                w = w + rng.choice(_PUNCT)
            parts.append(w)
        s = " ".join(parts) + rng.choice((".", ".", ".", "!", "?", ":", ""))
        if rng.random() < 0.2:
            s += "\n"
        out.append(s)
    return tuple(out)


@lru_cache(maxsize=4)
def build_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE (deterministic) and return its tokenizer.json text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    # The pipeline is exactly Qwen2's (NFC, Qwen's split regex, byte-level without its own
    # regex): transformers 5 builds a Qwen2Tokenizer for model_type qwen2 and re-creates that
    # pipeline from vocab + merges, so any other pipeline would tokenize differently there.
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, wanted {i}")
    return tok.to_str(pretty=True) + "\n"


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
    }
