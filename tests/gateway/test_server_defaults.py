"""An embedded server's engine on the CPU runs at most 128 sequences a step, as vLLM's server
there does (the library's engine keeps 256); a setting of its own wins."""

from __future__ import annotations

import dataclasses

import torch

from lockgate.engine import EngineConfig, server_engine_defaults
from lockgate.gateway.app import embedded_engine_kwargs
from lockgate.gateway.settings import Settings


def test_a_cpu_server_takes_128_sequences_and_a_setting_wins():
    assert {f.name: f.default for f in dataclasses.fields(EngineConfig)}["max_num_seqs"] == 256
    assert server_engine_defaults("cpu") == {"max_num_seqs": 128}
    assert server_engine_defaults("cuda") == {}
    expected = {} if torch.cuda.is_available() else {"max_num_seqs": 128}
    assert server_engine_defaults() == expected
    assert embedded_engine_kwargs(Settings(engine_kwargs={"device": "cpu"}))["max_num_seqs"] == 128
    assert embedded_engine_kwargs(Settings(engine_kwargs={"device": "cpu", "max_num_seqs": 300}))["max_num_seqs"] == 300
    assert "max_num_seqs" not in embedded_engine_kwargs(Settings(engine_kwargs={"device": "cuda"}))
