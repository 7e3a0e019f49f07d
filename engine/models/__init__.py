from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.models.loader import MODEL_CLASSES, load_model

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "MODEL_CLASSES", "load_model"]
