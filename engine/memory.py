"""One device memory budget: model weights, LoRA slots and KV blocks drawn from it.

The KV cache's size is what is left once everything else has reserved its share, so later
features (more models, adapter slots) shrink the cache through the same object instead of
recomputing a number somewhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CPU_DEFAULT_KV_BYTES = 512 * 1024**2
CUDA_ACTIVATION_HEADROOM = 1024**3   # forward activations, sampler and allocator slack


@dataclass(slots=True)
class MemoryBudget:
    total_bytes: int
    device: str
    reserved: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_device(
        cls,
        device: torch.device,
        *,
        gpu_memory_utilization: float,
        kv_cache_memory: int | None,
        weight_bytes: int,
        lora_bytes: int = 0,
    ) -> MemoryBudget:
        """CUDA: a share of the device's memory. CPU: the weights plus the KV bytes asked for
        (512 MiB by default), since host memory is not ours to take whole."""
        if device.type == "cuda":
            _, total = torch.cuda.mem_get_info(device)
            budget = cls(int(total * gpu_memory_utilization), str(device))
            budget.reserve("activations", CUDA_ACTIVATION_HEADROOM)
        else:
            kv = kv_cache_memory if kv_cache_memory is not None else CPU_DEFAULT_KV_BYTES
            budget = cls(weight_bytes + lora_bytes + kv, str(device))
        budget.reserve("weights", weight_bytes)
        if lora_bytes:
            budget.reserve("lora_slots", lora_bytes)
        return budget

    @property
    def used_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def reserve(self, name: str, num_bytes: int) -> None:
        if num_bytes < 0:
            raise ValueError(f"cannot reserve {num_bytes} bytes for {name}")
        if num_bytes > self.available_bytes + self.reserved.get(name, 0):
            raise MemoryError(
                f"memory budget: {name} needs {num_bytes / 2**20:.1f} MiB, "
                f"{self.available_bytes / 2**20:.1f} MiB left of {self.total_bytes / 2**20:.1f} MiB"
            )
        self.reserved[name] = num_bytes

    def release(self, name: str) -> int:
        return self.reserved.pop(name, 0)

    def kv_blocks(
        self, bytes_per_block: int, *, num_kv_blocks: int | None, kv_cache_memory: int | None
    ) -> int:
        """Size the KV cache and reserve it: an explicit block count wins, then an explicit
        byte count, then whatever the budget has left."""
        if num_kv_blocks is not None:
            num_blocks = num_kv_blocks
        elif kv_cache_memory is not None:
            num_blocks = kv_cache_memory // bytes_per_block
        else:
            num_blocks = self.available_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv cache: no room for a single block ({bytes_per_block} bytes); "
                f"raise kv_cache_memory or gpu_memory_utilization"
            )
        # An explicit count on CPU may exceed the default budget: grow the budget, not fail.
        if num_blocks * bytes_per_block > self.available_bytes and self.device == "cpu":
            self.total_bytes += num_blocks * bytes_per_block - self.available_bytes
        self.reserve("kv_cache", num_blocks * bytes_per_block)
        return num_blocks

    def summary(self) -> dict[str, int]:
        return {"total_bytes": self.total_bytes, **{f"{k}_bytes": v for k, v in self.reserved.items()}}
