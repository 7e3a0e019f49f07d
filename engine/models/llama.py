"""Llama-family decoder (Llama, Mistral, Qwen2) over one flattened batch and a paged cache.

The batch is every scheduled token of every sequence, concatenated: prefill chunks and
decodes together, no padding. Projections are fused (one QKV matmul, one gate/up matmul);
K and V are written into the cache in place and attention reads them back through the
block tables. Checkpoints load by Hugging Face's own weight names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockgate.engine.config import ModelConfig
from lockgate.engine.models.linear import DenseLinear, LinearBase, LinearFactory
from lockgate.engine.models.rope import RopeAt, RotaryEmbedding
from lockgate.engine.parallel.shard import Shard, SplitLayout
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


class Collectives(Protocol):
    """What a split model needs of its rank group (engine/parallel/group.py RankGroup)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None: ...


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


class TensorParallel:
    """A model's place in its rank group, shared by its layers: the `shard` it holds and the
    `comm` its row-parallel layers all-reduce through (None: one rank, nothing to sum; set
    once the group is up, after the weights are read)."""

    __slots__ = ("comm", "shard")

    def __init__(self, shard: Shard, comm: Collectives | None = None) -> None:
        self.shard, self.comm = shard, comm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.comm is None else self.comm.all_reduce(t)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory, tp: TensorParallel) -> None:
        super().__init__()
        (q0, self.num_heads), (kv0, self.num_kv_heads) = tp.shard.heads(cfg), tp.shard.kv_heads(cfg)
        self.head_dim = d = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.tp = tp
        self.qkv_proj = linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.attention_bias)
        self.o_proj = linear(self.q_size, [cfg.hidden_size], False)
        if not tp.shard.whole:
            kv = (kv0 * d, self.kv_size)
            q_total, kv_total = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
            self.qkv_proj.set_split(SplitLayout("column", ((q0 * d, self.q_size), kv, kv),
                                                (q_total, kv_total, kv_total)))
            self.o_proj.set_split(SplitLayout("row", ((q0 * d, self.q_size),), (q_total,)))

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
        # row-parallel: each rank's heads give a partial sum (adapters' deltas in it already)
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory, tp: TensorParallel) -> None:
        super().__init__()
        i0, inter = tp.shard.intermediate(cfg)
        self.tp = tp
        self.gate_up_proj = linear(cfg.hidden_size, [inter] * 2, False)
        self.down_proj = linear(inter, [cfg.hidden_size], False)
        if isinstance(self.gate_up_proj, DenseLinear):
            self.gate_up_proj.as_gate_up()
        if not tp.shard.whole:
            total = cfg.intermediate_size
            self.gate_up_proj.set_split(SplitLayout("column", ((i0, inter), (i0, inter)), (total, total)))
            self.down_proj.set_split(SplitLayout("row", ((i0, inter),), (total,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on the CPU in float32 the activation comes from the projection's own registers
        h = self.gate_up_proj.fused_silu_mul(x)
        return self.tp.all_reduce(self.down_proj(silu_mul(self.gate_up_proj(x)) if h is None else h))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding (token ids [start, start + rows)): ids elsewhere look
    up zeros, and the all-reduce fills them in from the rank holding them."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        rows = tp.shard.vocab_rows(cfg.vocab_size)
        super().__init__(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        self.start, self.num_real = tp.shard.vocab(cfg.vocab_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, linear, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, linear, tp)

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

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None, linear: LinearFactory = DenseLinear,
                 shard: Shard | None = None) -> None:
        """`rope` None: a skeleton (shapes and sizes, see loader.build_skeleton) that never runs.
        `shard`: the part of the model this rank holds (None: all of it)."""
        super().__init__()
        self.cfg = cfg
        self.tp = TensorParallel(shard or Shard())
        vocab_rows = self.tp.shard.vocab_rows(cfg.vocab_size)
        # built on the meta device and filled from the checkpoint: `_weight` / skip_init spare
        # the random init, which on meta tensors imports torch._dynamo (seconds of start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)) \
            if self.tp.shard.whole else VocabParallelEmbedding(cfg, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, linear, self.tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.utils.skip_init(
            nn.Linear, cfg.hidden_size, vocab_rows, bias=False, device=torch.empty(0).device)
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab]; with tensor parallelism each rank computes its vocabulary
        slice and rank 0 gets them all (the other ranks get None)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = dense_linear(hidden, weight, None, self._head_packed)
        comm = self.tp.comm
        if comm is None:
            return logits
        parts = comm.gather_to_first(logits)
        return None if parts is None else torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]

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

    def checkpoint_slicer(self) -> Callable[[str, int], tuple[slice, ...] | None]:
        """(HF tensor name, its number of dimensions) -> what this rank reads of it (None:
        all): its projections' slices and its rows of the vocabulary; None for every tensor
        when the model is whole."""
        if self.tp.shard.whole:
            return lambda name, ndim: None
        projections = self.projections()
        start, rows = self.tp.shard.vocab(self.cfg.vocab_size)

        def slices(hf_name: str, ndim: int) -> tuple[slice, ...] | None:
            name = hf_name.removeprefix("model.")
            layer, _, leaf = name.rpartition(".")
            if layer in projections:
                module, part = projections[layer]
                return module.checkpoint_slices(part, leaf, ndim)
            if name in VOCAB_SHARDED:
                return (slice(start, start + rows), slice(None))
            return None

        return slices

    def load_weights(self, weights) -> None:
        """Copy HF-named tensors into the model: projections part by part (dense or
        quantized alike), the rest by name. Raises on missing or unknown tensors. A rank of
        a split model is given its slices (`checkpoint_slicer`)."""
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
            _copy_param(hf_name, params[name].data, tensor, padded=name in VOCAB_SHARDED)
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


# the tensors split by vocabulary rows across ranks (a rank's last rows may be padding)
VOCAB_SHARDED = frozenset({"embed_tokens.weight", "lm_head.weight"})


def _copy_param(hf_name: str, dst: torch.Tensor, tensor: torch.Tensor, *, padded: bool) -> None:
    """dst <- tensor; a vocabulary slice shorter than its rank's rows fills the first ones and
    zeroes the padding."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if dst.shape != tensor.shape and not (padded and rows < dst.shape[0] and dst.shape[1:] == tensor.shape[1:]):
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    if dst.shape != tensor.shape:
        dst.zero_()
        dst = dst[:rows]
    dst.copy_(tensor.to(dst.dtype))
