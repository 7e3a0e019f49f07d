"""Build a model from a Hugging Face directory: config.json plus safetensors, sharded or not."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lockgate.engine.config import ModelConfig
from lockgate.engine.models.linear import DenseLinear
from lockgate.engine.models.llama import LlamaForCausalLM
from lockgate.engine.models.rope import RotaryEmbedding
from lockgate.engine.parallel.shard import Shard
from lockgate.engine.quant import linear_factory
from lockgate.kernels.linear import packs
from lockgate.kernels.linear.cpu import packed_numel

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no safetensors weights in {model_dir}")
    return files


# (tensor name, its number of dimensions) -> the slice to read, None for the whole tensor
Slicer = Callable[[str, int], "tuple[slice, ...] | None"]


def iter_weights(model_dir: Path, dtype: torch.dtype, slicer: Slicer | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, memory-mapped. With a `slicer` (a rank of a split model)
    only the slice it names is read of each tensor: the whole never sits in this process."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict: keys() is its API
                if slicer is None:
                    t = f.get_tensor(name)
                else:
                    view = f.get_slice(name)
                    cut = slicer(name, len(view.get_shape()))
                    t = view[cut] if cut is not None else view[:]
                # packed integer tensors (quantized checkpoints) keep their dtype
                yield name, t.to(dtype) if t.is_floating_point() else t


def build_skeleton(cfg: ModelConfig, dtype: torch.dtype, shard: Shard | None = None) -> LlamaForCausalLM:
    """The model (or one rank's `shard` of it) on the meta device: its shapes and byte sizes,
    no storage. Raises ValueError for an unsupported quantization before anything is read."""
    cls = MODEL_CLASSES[cfg.architecture]
    linear = linear_factory(cfg.quantization)
    with torch.device("meta"):
        model = cls(cfg, None, linear, shard)
    return model.to(dtype)


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (quantized projections keep their packed
    weights and scales as buffers)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def packed_weight_bytes(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes of the packed copies the CPU linear kernel keeps of dense projections and the
    vocabulary head (kernels/linear), where it runs: memory beside the weights."""
    if not packs(device, dtype):
        return 0
    total = sum(packed_numel(m.out_features, m.in_features, m.packed.pairs_of) for m in model.modules()
                if isinstance(m, DenseLinear))
    head = model.get_submodule("lm_head") if getattr(model, "lm_head", None) is not None \
        else model.get_submodule("embed_tokens")
    total += sum(packed_numel(p.shape[0], p.shape[1]) for name, p in head.named_parameters() if name == "weight")
    return total * torch.tensor([], dtype=dtype).element_size()


def load_model(
    model_dir: str | Path, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """The model, or with `shard` one rank's part of it (read slice by slice; its collectives
    are attached once the rank group is up: `model.tp.comm`)."""
    model_dir = Path(model_dir)
    cls = MODEL_CLASSES[cfg.architecture]
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    linear = linear_factory(cfg.quantization)
    with torch.device("meta"):   # no init work: every parameter is overwritten by the checkpoint
        model = cls(cfg, rope, linear, shard)
    model = model.to_empty(device=device).to(dtype)
    slicer = None if shard is None or shard.whole else model.checkpoint_slicer()
    with torch.no_grad():
        model.load_weights(iter_weights(model_dir, dtype, slicer))
    model.eval()
    return model
