"""Llama-family decoder (Llama, Mistral, Qwen2) over one flattened batch and a paged cache.

The batch is every scheduled token of every sequence, concatenated: prefill chunks and
decodes together, no padding. Projections are fused (one QKV matmul, one gate/up matmul);
K and V are written into the cache in place and attention reads them back through the
block tables. Checkpoints load by Hugging Face's own weight names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.rope import RopeAt, RotaryEmbedding
from kernels.paged_attention import paged_attention, write_kv_cache


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor      # [num_seqs, max_blocks]
    seq_lens: torch.Tensor          # [num_seqs] context length after this step
    query_start_loc: torch.Tensor   # [num_seqs + 1]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one fused op; same result as the spelled-out form
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # half types: normalize in fp32 as HF does, then scale in the model's dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAt,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(q), rope(k)
        key_cache, value_cache = kv_cache
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        o = paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale,
        )
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Also Mistral (same layout) and Qwen2 (q/k/v biases, usually tied embeddings)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.at(positions)      # cos/sin gathered once, used by every layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    # -- loading -----------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Copy HF-named tensors into the fused parameters. Raises on missing or unknown names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        q, kv = self.cfg.num_attention_heads * self.cfg.head_dim, self.cfg.num_key_value_heads * self.cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, self.cfg.intermediate_size),
            "up_proj": ("gate_up_proj", self.cfg.intermediate_size, self.cfg.intermediate_size),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            target, offset, size = name, 0, None
            for i, part in enumerate(parts):
                if part in fused:
                    new, offset, size = fused[part]
                    target = ".".join(parts[:i] + [new] + parts[i + 1 :])
                    break
            if target not in params:
                raise ValueError(f"checkpoint has an unexpected weight {hf_name!r}")
            param = params[target]
            dst = param.data if size is None else param.data.narrow(0, offset, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if size is None else f"{target}:{offset}")
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected |= {f"{pname}:0", f"{pname}:{q}", f"{pname}:{q + kv}"}
            elif pname.endswith("gate_up_proj.weight"):
                expected |= {f"{pname}:0", f"{pname}:{self.cfg.intermediate_size}"}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
