"""Multi-LoRA: the plain-torch SGMV reference everywhere for now; a device kernel (Punica /
S-LoRA style SGMV) will be picked on CUDA when it lands, with the same signature."""

from kernels.lora.reference import lora_masked, lora_shrink_expand, sgmv, slot_mask

__all__ = ["lora_masked", "lora_shrink_expand", "sgmv", "slot_mask"]
