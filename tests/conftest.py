"""Test session set-up: offline, and block accounting checked at every engine step."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["LOCKGATE_CHECK_INVARIANTS"] = "1"
# the engine adapts its thread count to the cores other processes leave (engine/threads.py):
# off in tests, whose outputs are compared across runs (a width change midway changes float
# sums); tests/engine/test_threads.py turns it on
os.environ.setdefault("LOCKGATE_ADAPTIVE_THREADS", "0")
# The Triton kernels' tests run them on CPU tensors in Triton's interpreter, which triton
# reads once, when first imported, and anything collected may import it first (peft and
# transformers look for it): so it is set here, for the whole session, unless set already
# (scripts/device-check.sh sets TRITON_INTERPRET=0 on a GPU machine: compiled, on CUDA).
os.environ.setdefault("TRITON_INTERPRET", "1")

import weakref

import pytest

from lockgate.engine.engine_core import EngineCore

pytest_plugins = ["tests.support.services"]

_CORES: "weakref.WeakSet[EngineCore]" = weakref.WeakSet()
_init = EngineCore.__init__


def _tracked_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    _CORES.add(self)


EngineCore.__init__ = _tracked_init


@pytest.fixture(autouse=True)
def all_blocks_free_after_each_test():
    """After every test, every engine still alive holds no KV block and no request."""
    yield
    for core in list(_CORES):
        core.verify()
        assert core.kv.num_used_blocks == 0, f"{core.kv.num_used_blocks} KV blocks still held"
        assert not core.requests, f"requests left in the engine: {list(core.requests)[:3]}"
