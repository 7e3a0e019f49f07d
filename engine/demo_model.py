"""Offline, deterministic demo models (llama / qwen2 / mistral) for tests and demos.

``write_demo_model(out_dir, family=..., size=..., seed=...)`` writes a complete Hugging Face
model directory (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a ChatML template, special_tokens_map.json) without any network.
The same (family, size, seed) gives byte-identical files; the seed changes only the weights.

Tokenizer: byte-level BPE trained with `tokenizers` on a synthetic, seed-independent corpus
(Zipf-distributed pseudo-words, digits, punctuation, accented / CJK / emoji strings); 512 tokens
(tiny), 509 (tiny-mqa) or 8192 (small), special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2. Its
pipeline is Qwen2's (NFC + Qwen's split regex + byte level) so transformers' Qwen2Tokenizer,
which rebuilds that pipeline for model_type qwen2, tokenizes exactly like tokenizer.json.

Weights are random but drawn so that greedy decoding is decisive and depends on the whole
context (an engine with broken attention, positions, GQA mapping, norms or biases diverges
from HF at once): sharp attention (q/k std 2 -> attention logits std ~4), layer outputs larger
than the embedding in the residual stream, logits with std ~24, norm weights jittered by +-20%,
lm_head rows leaning away from the token's own embedding (untied) or a layer-0 "anti-copy"
head (tied qwen2) so greedy does not lock into "t t t" loops, and special-token rows scaled by
0.2 so greedy practically never emits EOS.

MEASURED (seed 0; transformers 5.24.0, torch 2.13 CPU, fp32, HF sdpa attention; prompts =
random_prompts(V): 16 prompts of random non-special ids, lengths 1, 300, 7, 66, 117, 65, 133,
226, 176, 130, 244, 242, 155, 83, 64, 43; plus 4 plain-text prompts and 1 chat-template
prompt for the gap statistics; greedy, 32 new tokens, KV cache):

  family/size    gap min  (where)               gap p5  gap median  distinct  tokens/cont  EOS
  llama tiny     0.0026   text "The quick..."   0.36    5.4         16/16     >= 25        0/21
  qwen2 tiny     0.0020   random prompt #13     0.41    4.9         16/16     >= 21        0/21
  mistral tiny   0.030    random prompt #10     0.50    5.9         16/16     >= 27        0/21
  llama small    0.0126   random prompt #13     0.36    4.4         16/16     >= 28        0/21
  qwen2 small    0.0059   random prompt #2      0.34    4.4         16/16     >= 29        0/21
  mistral small  0.0012   random prompt #0 (len 1)  0.40  4.4       16/16     >= 27        0/21

  llama tiny-mqa 0.0012  (float64; random_prompts(509, 32, seed=3), 24 new tokens)  32/32 distinct, 0 EOS

  (gap = top-1 minus top-2 logit at each generated step; "tokens/cont" = distinct tokens in
  each 32-token continuation; no continuation has one token in more than 16% of its steps.)
  Context dependence, every family and size: prompt positions reversed -> 14/14 continuations
  of prompts longer than 8 change; only the first token changed -> 14/14 of prompts longer than
  16 change; attention mask zero on prompt positions [n/4, n/2) -> 14/14 change. Shifting all
  position_ids by +5 changes 0/14, as it must: RoPE (llama3-scaled too) only sees relative
  positions, so a shift is a no-op up to float noise.
  Float noise for scale: fp32 vs fp64 logits differ by <= 4.2e-4, sdpa vs eager by <= 2.7e-4
  (logit std ~24 over the vocabulary).
  Other seeds (1..7, tiny, the 16 random prompts): no degenerate continuation; min gap
  llama >= 0.005, mistral >= 0.010, qwen2 0.0002 .. 0.025 (tied embeddings decide less
  sharply: below 2e-3 for seeds 2, 4, 6).
  Time to write (fresh process, after imports): tiny ~0.4 s, small ~0.75 s (corpus 0.14 s,
  BPE training 0.2 s tiny / 0.4 s small, both cached per process).
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import pathlib
from typing import Any

import torch

from lockgate.engine.demo_tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    SPECIAL_TOKENS,
    build_tokenizer_json,
    special_tokens_map,
    tokenizer_config,
)

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT_ID",
    "FAMILIES",
    "IM_END_ID",
    "IM_START_ID",
    "SIZES",
    "SPECIAL_TOKENS",
    "build_config",
    "build_state_dict",
    "build_tokenizer_json",
    "random_prompts",
    "write_demo_model",
    "write_model_dir",
]

FAMILIES = ("llama", "qwen2", "mistral")

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
    # one KV head for all four query heads (multi-query attention): split across ranks, each
    # rank holds the same KV head; an odd vocabulary, which no rank count divides, so a split
    # vocabulary is padded
    "tiny-mqa": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=128,
        vocab_size=509,
        max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=704,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
}

# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


def _check_args(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")


def build_config(family: str, size: str) -> dict[str, Any]:
    """The config.json contents (a plain dict) for one family and size.

    RoPE settings are written twice, consistently: the legacy top-level ``rope_theta`` /
    ``rope_scaling`` that transformers 4.x reads, and ``rope_parameters`` that transformers 5.x
    writes (5.x gives ``rope_scaling`` priority when both are present; they are identical here).
    """
    _check_args(family, size)
    s = SIZES[size]
    cfg: dict[str, Any] = dict(s)
    cfg.update(
        hidden_act="silu",
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        use_cache=True,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    rope_theta, rope_scaling = _family_config(family, s["num_hidden_layers"], cfg)
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters.update(rope_scaling)
    cfg["rope_parameters"] = rope_parameters
    return cfg


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": None,
        "do_sample": False,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


def _family_config(family: str, n: int, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Add the family's own fields to `cfg` (for `n` layers); its RoPE theta and scaling."""
    if family == "llama":
        rope_theta = 10000.0
        rope_scaling: dict[str, Any] | None = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        cfg.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
        )
    elif family == "qwen2":
        rope_theta = 1000000.0
        rope_scaling = None
        cfg.update(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=n,
            layer_types=["full_attention"] * n,
        )
    else:  # mistral
        rope_theta = 10000.0
        rope_scaling = None
        cfg.update(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            tie_word_embeddings=False,
            sliding_window=None,
        )
    return rope_theta, rope_scaling


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------

# Scales (see the measurements in the module docstring). Inputs to every projection are
# RMS-normalised (rms ~ 1), so a weight std of c / sqrt(fan_in) gives outputs of std ~ c.
_EMBED_STD = 1.0
# Tied (qwen2): the embedding is also the lm_head; a token's own row would then dominate its
# logits (greedy repeats the last token forever), so the embedding is kept small next to the
# layer outputs in the residual stream (every layer RMS-normalises its input anyway).
_EMBED_STD_TIED = 0.05
_QK_STD = 2.0  # q and k entries ~ N(0, 2^2): attention logits have std ~ 4 -> sharp attention
_ATTN_OUT = (2.0, 4.0)  # o_proj output scale per layer position (first, last; geometric between)
_MLP_OUT = (1.0, 2.0)
_LOGIT_STD = 24.0  # std of the logits over the vocabulary
# lm_head rows of the special tokens: their logits have std 0.2 x the others', so greedy
# practically never emits EOS (for qwen2 the same rows are the input embeddings; 0.2 keeps
# their mean square 10x above rms_norm_eps).
_SPECIAL_LOGIT_SCALE = 0.2
_ANTI_SELF = 1.0  # untied: lm_head rows mix in -embedding (see build_state_dict)
_ANTI_COPY = 3.0  # tied: strength of the layer-0 anti-copy heads (see build_state_dict)
_NORM_JITTER = 0.2  # norm weights ~ U(1 - j, 1 + j): an engine that ignores them is caught
_BIAS_STD = 0.1  # qwen2 q/k/v biases (large ones make a few keys attract every query)


def _seed_for(family: str, size: str, seed: int) -> int:
    h = hashlib.sha256(f"lockgate-demo/{family}/{size}/{int(seed)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def build_state_dict(family: str, size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights, in Hugging Face's names, fp32, contiguous, drawn from a seeded CPU generator."""
    _check_args(family, size)
    s = SIZES[size]
    H, L = s["hidden_size"], s["num_hidden_layers"]
    nh, nkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    inter, V = s["intermediate_size"], s["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(_seed_for(family, size, seed))

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + (torch.rand((H,), generator=g, dtype=torch.float32) * 2 - 1) * _NORM_JITTER

    def interp(pair: tuple[float, float], i: int) -> float:
        if L == 1:
            return pair[1]
        return pair[0] * (pair[1] / pair[0]) ** (i / (L - 1))

    sd: dict[str, torch.Tensor] = {}
    tied = family == "qwen2"
    embed = normal((V, H), _EMBED_STD_TIED if tied else _EMBED_STD)
    if tied:
        # the same matrix is the lm_head: its std sets the logit scale together with model.norm
        embed[: len(SPECIAL_TOKENS)] *= _SPECIAL_LOGIT_SCALE
    sd["model.embed_tokens.weight"] = embed
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight()
        sd[p + "self_attn.q_proj.weight"] = normal((nh * d, H), _QK_STD / math.sqrt(H))
        sd[p + "self_attn.k_proj.weight"] = normal((nkv * d, H), _QK_STD / math.sqrt(H))
        sd[p + "self_attn.v_proj.weight"] = normal((nkv * d, H), 1.0 / math.sqrt(H))
        if family == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = normal((nh * d,), _BIAS_STD)
            sd[p + "self_attn.k_proj.bias"] = normal((nkv * d,), _BIAS_STD)
            sd[p + "self_attn.v_proj.bias"] = normal((nkv * d,), _BIAS_STD)
        o_std = interp(_ATTN_OUT, i) / math.sqrt(nh * d)
        sd[p + "self_attn.o_proj.weight"] = normal((H, nh * d), o_std)
        if tied and i == 0 and _ANTI_COPY:
            _anti_copy_heads(sd, p, nh // nkv, d)
        sd[p + "post_attention_layernorm.weight"] = norm_weight()
        sd[p + "mlp.gate_proj.weight"] = normal((inter, H), 1.0 / math.sqrt(H))
        sd[p + "mlp.up_proj.weight"] = normal((inter, H), 1.0 / math.sqrt(H))
        sd[p + "mlp.down_proj.weight"] = normal((H, inter), interp(_MLP_OUT, i) / math.sqrt(inter))
    final = norm_weight()
    if tied:
        final *= _LOGIT_STD / (_EMBED_STD_TIED * math.sqrt(H))
    sd["model.norm.weight"] = final
    if not tied:
        head = normal((V, H), _LOGIT_STD / math.sqrt(H))
        if _ANTI_SELF:
            # lm_head rows lean away from the token's own embedding: the current token (still
            # part of the residual stream) is pushed down, so greedy rarely locks into "t t t".
            head -= (_ANTI_SELF * _LOGIT_STD / (_EMBED_STD * math.sqrt(H))) * embed
            head /= math.sqrt(1.0 + _ANTI_SELF**2)
        head[: len(SPECIAL_TOKENS)] *= _SPECIAL_LOGIT_SCALE
        sd["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in sd.items()}


def _anti_copy_heads(sd: dict[str, torch.Tensor], prefix: str, group: int, d: int) -> None:
    """One "anti-copy" kv group in a layer: its query heads attend to keys of the same token
    (q = k projection) and write minus the value back (o = -v^T), so tokens already in the
    context are pushed down in the tied lm_head: the tied-embedding analogue of _ANTI_SELF,
    which keeps greedy out of "t t t" loops on short prompts."""
    k0 = sd[prefix + "self_attn.k_proj.weight"][:d]
    v0 = sd[prefix + "self_attn.v_proj.weight"][:d]
    for h in range(group):
        sd[prefix + "self_attn.q_proj.weight"][h * d : (h + 1) * d] = k0
        o_block = (-_ANTI_COPY / group) * v0.T
        sd[prefix + "self_attn.o_proj.weight"][:, h * d : (h + 1) * d] = o_block


def random_prompts(
    vocab_size: int, n: int = 16, *, seed: int = 1234, min_len: int = 1, max_len: int = 300
) -> list[list[int]]:
    """Seeded prompts of random token ids (never a special token), lengths in [min_len, max_len];
    the first two have the extreme lengths. The prompts the numbers in the docstring were
    measured on are ``random_prompts(vocab_size)``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    lens[: min(n, 2)] = [min_len, max_len][: min(n, 2)]
    lo = len(SPECIAL_TOKENS)
    return [torch.randint(lo, vocab_size, (k,), generator=g).tolist() for k in lens]


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _dump_json(path: pathlib.Path, obj: Any) -> None:
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def write_demo_model(
    out_dir: str | os.PathLike, *, family: str = "llama", size: str = "tiny", seed: int = 0
) -> pathlib.Path:
    """Write a complete Hugging Face model directory (config, safetensors weights, generation
    config, fast tokenizer with a ChatML template) into ``out_dir`` and return its path.

    Fully offline and deterministic: the same (family, size, seed) gives byte-identical files.
    """
    _check_args(family, size)
    try:
        seed = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be an int, got {seed!r}") from None
    return write_model_dir(out_dir, build_config(family, size), build_state_dict(family, size, seed))


def write_model_dir(out_dir: str | os.PathLike, cfg: dict[str, Any],
                    state_dict: dict[str, torch.Tensor]) -> pathlib.Path:
    """Write a model directory from its config.json contents and its weights, with the demo
    tokenizer of ``cfg["vocab_size"]`` tokens (512 or 8192) and the demo generation config."""
    from safetensors.torch import save

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _dump_json(out / "config.json", cfg)
    _dump_json(out / "generation_config.json", _generation_config())
    (out / "tokenizer.json").write_text(build_tokenizer_json(cfg["vocab_size"]), encoding="utf-8")
    _dump_json(out / "tokenizer_config.json", tokenizer_config(cfg["max_position_embeddings"]))
    _dump_json(out / "special_tokens_map.json", special_tokens_map())
    (out / "model.safetensors").write_bytes(save(state_dict, metadata={"format": "pt"}))
    return out
