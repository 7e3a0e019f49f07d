"""A rank's KV cache tensors, behind one interface (`KVCacheOps`: allocate, copy, free) that
the rank group's fan-out implements too (engine/parallel/executor.py), so that what moves
blocks (a copy-on-write, a speculative draft's rollback, a KV tier's swap) is written once
for one rank and for N.

The block manager (manager.py, block_pool.py) decides which block ids a sequence holds; these
tensors are where those ids point, one [num_kv_heads, num_blocks, block_size, head_dim] K and V
per layer: with tensor parallelism each rank holds its own KV heads' share, the block ids the
same on every rank."""

from __future__ import annotations

from typing import Protocol

import torch


class KVCacheOps(Protocol):
    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The cache sized to `num_blocks` blocks of `block_size` tokens (contents undefined)."""
        ...

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block src[i]'s K and V copied into block dst[i], every layer."""
        ...

    def free(self) -> None:
        """The tensors dropped (the device memory given back)."""
        ...


class DeviceKVCache:
    """One rank's K and V tensors per layer; `layers` is what the model's forward reads."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.block_size = 0

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """`empty`, not `zeros`: pages are touched only as blocks are used. Attention masks
        (and zeroes) every slot past a sequence's length, so unwritten slots never count."""
        shape = (self.num_kv_heads, num_blocks, block_size, self.head_dim)
        self.layers = []     # the old tensors go before the new ones are made
        self.layers = [
            (torch.empty(shape, dtype=self.dtype, device=self.device),
             torch.empty(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        self.num_blocks, self.block_size = num_blocks, block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k, v in self.layers:
            k[:, d] = k[:, s]
            v[:, d] = v[:, s]

    def free(self) -> None:
        self.layers = []
