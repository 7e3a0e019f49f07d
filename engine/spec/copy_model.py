"""Demo models that quote their prompt: Llama checkpoints whose weights are set by hand so that
greedy decoding repeats spans of the context, as real models do when they quote code. The
random demo models (engine/demo_model.py) are built never to copy, so an n-gram draft is never
accepted there; on these, a quoted span is accepted token after token.

Two layers, MLPs zero, norm weights one. The residual stream holds, in separate dimensions,
the token's embedding a_t (E dims, norm sqrt(E), random and so nearly orthogonal across the
vocabulary), a constant (so attention can have a token-independent query), the embeddings of
the n tokens before it (written by layer 0) and the copied token's (written by layer 1):

- layer 0, n previous-token heads, head h for offset h + 1: q and k read only the constant.
  In each of the head's fast rotary pairs (the first d / 8, frequency theta_i) q is c and k is
  c e^{i (h+1) theta_i}, so after RoPE q.k = c^2 sum_i cos((m - n - h - 1) theta_i): largest
  at offset h + 1, every other offset at least sum_i (1 - cos theta_i) lower (about 0.7 for
  16 pairs; the neighbouring offsets are the closest), scaled so that gap is _PREV_GAP in
  attention logits (softmax one-hot to e^-30). Its value is the token's embedding.
- layer 1, an induction head over the slow pairs (rope_theta 1e16: frequencies <= 1e-4, so
  2,048 positions turn them by at most 0.2 rad: content, not position, decides). q holds the
  current token and the n - 1 before it, k at position s the n tokens before s, part by part:
  a position s that the current token followed before scores _MATCH, and each earlier token
  that matches too adds _EARLIER_WEIGHT times the later one's share (random tokens: a random
  fraction). Its value, the embedding of the token at s, goes to the copy dimensions. Matching
  n tokens, not one, keeps a quote on its track past common tokens (the tiny tokenizer
  splits most words into a few tokens).
- the LM head reads the copy dimensions against each token's embedding (the copied token
  wins by a wide margin), plus a weak random bigram table from the current token, so text with
  nothing to copy is still random text; special tokens' rows are scaled down (no early EOS).

The target matches n = 3 tokens with hidden 256, head size 128 and four heads (one idle:
transformers wants the hidden size divisible by the heads), E = 32; the draft n = 2 with
hidden 128, head size 64 and two heads, E = 24: where the target quotes, so does the draft.
Code tokenized by the tiny tokenizer (mostly single characters, runs of spaces) still
confuses both: three tokens of indentation are followed by many things.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
import pathlib
from typing import Any

import torch

from lockgate.engine.demo_model import SPECIAL_TOKENS, build_config, write_model_dir

ROPE_THETA = 1e16    # pairs past the first d/8 turn by <= 1e-4 rad a position: position-blind
_PREV_GAP = 30.0     # attention logits: the wanted offset above every other offset by this much
_MATCH = 50.0        # attention logits: the current token matches (random others: N(0, _MATCH^2 / E))
_EARLIER_WEIGHT = 0.6  # each earlier token that matches too adds this times the later one's
_COPY_LOGIT = 30.0   # LM head: the copied token's logit (others: N(0, _COPY_LOGIT^2 / E))
_BIGRAM_STD = 2.0    # LM head: std of the random bigram logits, what decides with nothing to copy
_SPECIAL_SCALE = 0.2

# (hidden, heads, head_dim, n): an induction head matching the last n tokens, n previous-token
# heads (heads past them are zero: transformers wants hidden divisible by heads). The
# embedding width E is 3 head_dim / 4n: the n tokens' E dimensions fill the slow pairs, the
# previous-token heads use the other d / 8 pairs
_SHAPES = {"target": (256, 4, 128, 3), "draft": (128, 2, 64, 2)}
VOCAB_SIZES = {"tiny": 512, "small": 8192}


def build_copy_config(size: str = "tiny", *, draft: bool = False) -> dict[str, Any]:
    """config.json of the copy model (or its draft) over the demo tokenizer of `size`."""
    if size not in VOCAB_SIZES:
        raise ValueError(f"size must be one of {tuple(VOCAB_SIZES)} for a copy model, got {size!r}")
    hidden, heads, head_dim, n = _SHAPES["draft" if draft else "target"]
    cfg = build_config("llama", size)
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
               copy_context=n,
               intermediate_size=64, num_hidden_layers=2, rope_theta=ROPE_THETA, rope_scaling=None,
               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False)
    return cfg


def build_copy_state_dict(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights, in Hugging Face's names, fp32; only the embeddings and the bigram table are random."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    lay = _Layout(hidden, cfg["head_dim"], cfg["copy_context"])
    width = lay.width
    g = torch.Generator().manual_seed(_seed_for(cfg, seed))
    emb = torch.randn(vocab, width, generator=g)
    emb *= math.sqrt(width) / emb.norm(dim=1, keepdim=True)
    embed = torch.zeros(vocab, hidden)
    embed[:, lay.token] = emb
    embed[:, lay.const] = math.sqrt(width)
    sd = {"model.embed_tokens.weight": embed}
    # the stream's RMS before each norm: token and constant, then n earlier tokens, then the copy
    n = len(lay.previous)
    rms = [math.sqrt(parts * width / hidden) for parts in (2, 2 + n, 3 + n)]
    for i, attn in enumerate((_previous_token_heads(cfg, lay, rms[0]), _induction_head(cfg, lay, rms[1]))):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn." + k: v for k, v in attn.items()})
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        sd[p + "mlp.gate_proj.weight"] = torch.zeros(cfg["intermediate_size"], hidden)
        sd[p + "mlp.up_proj.weight"] = torch.zeros(cfg["intermediate_size"], hidden)
        sd[p + "mlp.down_proj.weight"] = torch.zeros(hidden, cfg["intermediate_size"])
    sd["model.norm.weight"] = torch.ones(hidden)
    head = torch.zeros(vocab, hidden)
    head[:, lay.copied] = emb * (_COPY_LOGIT * rms[2] / width)
    head[:, lay.token] = torch.randn(vocab, width, generator=g) * (_BIGRAM_STD * rms[2] / math.sqrt(width))
    head[: len(SPECIAL_TOKENS)] *= _SPECIAL_SCALE
    sd["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in sd.items()}


def write_copy_model(out_dir: str | os.PathLike, *, draft: bool = False, size: str = "tiny",
                     seed: int = 0) -> pathlib.Path:
    """Write the copy model (or, `draft`, its smaller draft) as a Hugging Face directory with the
    demo tokenizer of `size` (tiny: 512 tokens, small: 8192); the same arguments, the same bytes."""
    try:
        seed = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be an int, got {seed!r}") from None
    cfg = build_copy_config(size, draft=draft)
    return write_model_dir(out_dir, cfg, build_copy_state_dict(cfg, seed))


class _Layout:
    """Where each part of the residual stream lives (hidden >= (n + 3) E), and the head's pairs."""

    def __init__(self, hidden: int, head_dim: int, n: int) -> None:
        half = head_dim // 2
        num_slow = 3 * half // 4                                      # pairs; the first d / 8 are fast
        width = self.width = 2 * num_slow // n
        self.token = slice(0, width)                                  # a_t
        self.const = width                                            # a constant
        # a_{t-1} .. a_{t-n}, from layer 0
        self.previous = tuple(slice((2 + i) * width, (3 + i) * width) for i in range(n))
        self.copied = slice(hidden - width, hidden)                   # the copied token, from layer 1
        if self.previous[-1].stop > self.copied.start:
            raise ValueError(f"hidden size {hidden} is too small for {n} tokens of {width}")
        # rotate-half layout: pair i is dimensions i and i + half, frequency ROPE_THETA^(-2i/d)
        self.fast = torch.arange(half - num_slow)                     # first coordinates only
        self.slow = torch.cat([torch.arange(half - num_slow, half), torch.arange(2 * half - num_slow, 2 * half)])
        self.theta = ROPE_THETA ** (-2 * self.fast.double() / head_dim)


def _previous_token_heads(cfg: dict[str, Any], lay: _Layout, rms: float) -> dict[str, torch.Tensor]:
    """Head h attends to the token h + 1 positions back and writes its embedding to previous[h]."""
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    half, width = d // 2, lay.width
    margin = float((1 - lay.theta.cos()).sum())              # the offsets next to the peak are the closest
    c = math.sqrt(_PREV_GAP * math.sqrt(d) / margin)
    unit = c * rms / math.sqrt(width)                        # the constant is sqrt(E) / rms after the norm
    q, k, v, o = _zeros_attn(hidden, cfg["num_attention_heads"], d)
    cols = torch.arange(width)
    for h, target in enumerate(lay.previous):
        phase = (h + 1) * lay.theta
        q[h * d + lay.fast, lay.const] = unit
        k[h * d + lay.fast, lay.const] = (unit * phase.cos()).float()
        k[h * d + half + lay.fast, lay.const] = (unit * phase.sin()).float()
        v[h * d + cols, lay.token.start + cols] = rms
        o[target.start + cols, h * d + cols] = 1.0
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "o_proj.weight": o}


def _induction_head(cfg: dict[str, Any], lay: _Layout, rms: float) -> dict[str, torch.Tensor]:
    """Head 0 attends to where the last n tokens came before (the current one weighs most),
    and writes the embedding of the token that followed there to `copied`."""
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    width = lay.width
    s = math.sqrt(_MATCH * math.sqrt(d) / width)             # a_t . a_t = E -> _MATCH after 1/sqrt(d)
    q, k, v, o = _zeros_attn(hidden, cfg["num_attention_heads"], d)
    cols = torch.arange(width)
    # q part i: the token i back (i = 0: the current one); k part i: the token i + 1 back
    q_parts = [lay.token, *lay.previous[:-1]]
    for i, (q_src, k_src) in enumerate(zip(q_parts, lay.previous, strict=True)):
        dims = lay.slow[i * width:(i + 1) * width]
        q[dims, q_src.start + cols] = _EARLIER_WEIGHT**i * s * rms
        k[dims, k_src.start + cols] = s * rms
    v[cols, lay.token.start + cols] = rms
    o[lay.copied.start + cols, cols] = 1.0
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "o_proj.weight": o}


def _zeros_attn(hidden: int, heads: int, d: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, o projections, all zero: head 0 is set by hand, any other head attends evenly to nothing."""
    return (torch.zeros(heads * d, hidden), torch.zeros(heads * d, hidden),
            torch.zeros(heads * d, hidden), torch.zeros(hidden, heads * d))


def _seed_for(cfg: dict[str, Any], seed: int) -> int:
    h = hashlib.sha256(f"lockgate-copy/{cfg['vocab_size']}/{cfg['hidden_size']}/{int(seed)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
