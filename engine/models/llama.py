"""Llama-family decoder (Llama, Mistral, Qwen2) over one flattened batch and a paged cache.

The batch is every scheduled token of every sequence, concatenated: prefill chunks and
decodes together, no padding. Projections are fused (one QKV matmul, one gate/up matmul);
K and V are written into the cache in place and attention reads them back through the
block tables. Checkpoints load by Hugging Face's own weight names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from lockgate.engine.config import ModelConfig
from lockgate.engine.models.linear import DenseLinear, LinearBase, LinearFactory
from lockgate.engine.models.rope import RopeAt, RotaryEmbedding
from lockgate.kernels.linear import PackedWeight
from lockgate.kernels.linear import linear as dense_linear
from lockgate.kernels.paged_attention import contiguous_first_slots, paged_attention
from lockgate.kernels.pointwise import add_rms_norm, rms_norm, rope_write_kv, silu_mul


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor      # [num_seqs, max_blocks]
    seq_lens: torch.Tensor          # [num_seqs] context length after this step
    query_start_loc: torch.Tensor   # [num_seqs + 1]
    # per sequence, the cache slot of its first token when its blocks are consecutive ids,
    # else -1: worked out once per forward (by the model) for every layer's attention
    first_slots: list[int] | None = None
    # what an attention path works out from this metadata once for every layer of a forward
    step_cache: dict = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place (x None: nothing added), then the norm of it, in one pass."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.attention_bias)
        self.o_proj = linear(self.q_size, [cfg.hidden_size], False)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAt,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        # q and k rotated, k and v written into the cache, in one pass on the CPU
        q = rope_write_kv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, rope.cos, rope.sin,
                          key_cache, value_cache, meta.slot_mapping)
        o = paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, meta.first_slots, meta.step_cache,
        )
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory) -> None:
        super().__init__()
        self.gate_up_proj = linear(cfg.hidden_size, [cfg.intermediate_size] * 2, False)
        self.down_proj = linear(cfg.intermediate_size, [cfg.hidden_size], False)
        if isinstance(self.gate_up_proj, DenseLinear):
            self.gate_up_proj.as_gate_up()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on the CPU in float32 the activation comes from the projection's own registers
        h = self.gate_up_proj.fused_silu_mul(x)
        return self.down_proj(silu_mul(self.gate_up_proj(x)) if h is None else h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, linear)

    def forward(self, x, residual, rope, kv_cache, meta):
        """x: the previous layer's MLP output, added to `residual` (the hidden state, updated
        in place; x None in the first layer, whose residual is the embedding). Returns this
        layer's MLP output; the caller's residual now holds the state before it."""
        h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Also Mistral (same layout) and Qwen2 (q/k/v biases, usually tied embeddings)."""

    # HF layer name -> (our fused projection, part index)
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "o_proj": ("o_proj", 0),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    }

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None, linear: LinearFactory = DenseLinear) -> None:
        """`rope` None: a skeleton (shapes and sizes, see loader.build_skeleton) that never runs."""
        super().__init__()
        self.cfg = cfg
        # built on the meta device and filled from the checkpoint: `_weight` / skip_init spare
        # the random init, which on meta tensors imports torch._dynamo (seconds of start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, linear) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.utils.skip_init(
            nn.Linear, cfg.hidden_size, cfg.vocab_size, bias=False, device=torch.empty(0).device)
        self.rope = rope
        self._head_packed = PackedWeight()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        if self.rope is None:
            raise RuntimeError("a model skeleton has no rotary embedding and does not run")
        x = self.embed_tokens(input_ids)
        rope = self.rope.at(positions)      # cos/sin gathered once, used by every layer
        if kv_caches and meta.first_slots is None:     # likewise the contiguity of each table
            meta.first_slots = contiguous_first_slots(meta.block_tables, meta.seq_lens,
                                                      kv_caches[0][0].shape[2])
        residual, x = x, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, residual, rope, kv_cache, meta)
        return self.norm.add_forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight, None, self._head_packed)

    # -- loading -----------------------------------------------------------------------------
    def projections(self) -> dict[str, tuple[LinearBase, int]]:
        """HF layer path without the "model." prefix (e.g. "layers.0.self_attn.q_proj") ->
        (the projection holding it, its part index)."""
        out: dict[str, tuple[LinearBase, int]] = {}
        for name, module in self.named_modules():
            if isinstance(module, LinearBase):
                parent, _, ours = name.rpartition(".")
                for hf, (fused, part) in self.FUSED.items():
                    if fused == ours:
                        out[f"{parent}.{hf}"] = (module, part)
        return out

    def load_weights(self, weights) -> None:
        """Copy HF-named tensors into the model: projections part by part (dense or
        quantized alike), the rest by name. Raises on missing or unknown tensors."""
        params = dict(self.named_parameters())
        projections = self.projections()
        loaded: set[str] = set()
        loaded_parts: set[tuple[str, int, str]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            layer, _, leaf = name.rpartition(".")
            if layer in projections:
                module, part = projections[layer]
                try:
                    module.load_part(part, leaf, tensor)
                except ValueError as exc:
                    raise ValueError(f"weight {hf_name!r}: {exc}") from None
                loaded_parts.add((layer, part, leaf))
                continue
            if name not in params:
                raise ValueError(f"checkpoint has an unexpected weight {hf_name!r}")
            dst = params[name].data
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            loaded.add(name)
        owned = {name for name, m in self.named_modules() if isinstance(m, LinearBase)}
        expected = {n for n in params if n.rpartition(".")[0] not in owned}
        missing = sorted(expected - loaded)
        for layer, (module, part) in projections.items():
            missing += sorted(
                f"{layer}.{leaf}" for p, leaf in module.expected_tensors()
                if p == part and (layer, part, leaf) not in loaded_parts
            )
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
