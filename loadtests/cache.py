"""Where the benchmarks keep what they build once and reuse (the demo models they run on):
`LOCKGATE_CACHE_DIR` when set, else `cache/` under the data directory (`LOCKGATE_DATA_DIR`,
default `~/.local/share/lockgate`), beside everything else Lockgate writes. Deleting it
costs a rebuild (about a second a model), nothing else."""

from __future__ import annotations

import os
from pathlib import Path

from lockgate.gateway.settings import default_data_dir


def cache_dir() -> Path:
    given = os.environ.get("LOCKGATE_CACHE_DIR") or os.environ.get("LOCKGATE_CACHE")   # the old name
    if given:
        return Path(given).expanduser()
    data = os.environ.get("LOCKGATE_DATA_DIR")
    return (Path(data).expanduser() if data else default_data_dir()) / "cache"


def demo_model_dir(family: str = "llama", size: str = "small", seed: int = 0) -> Path:
    """A demo model under `cache_dir()/demo-models`, written on first use."""
    path = cache_dir() / "demo-models" / f"{family}-{size}-seed{seed}"
    if not all((path / f).is_file() for f in ("config.json", "tokenizer.json", "model.safetensors")):
        from lockgate.engine.demo_model import write_demo_model

        write_demo_model(path, family=family, size=size, seed=seed)
    return path
