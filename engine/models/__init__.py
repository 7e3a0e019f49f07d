"""Decoder-only model families over a flattened batch and the paged cache, and their loader."""

from lockgate.engine.models.llama import AttentionMetadata, LlamaForCausalLM
from lockgate.engine.models.loader import MODEL_CLASSES, build_skeleton, load_model, tensor_bytes

__all__ = ["MODEL_CLASSES", "AttentionMetadata", "LlamaForCausalLM", "build_skeleton", "load_model",
           "tensor_bytes"]
