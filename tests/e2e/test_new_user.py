"""What a new user hit on the command line and in the engine, each fixed and kept so: help
that keeps option names whole at 80 columns, `lockgate quantize --method awq` working on its
own defaults, vLLM's engine flags mapped onto the engine, `LLM.generate` silent when its
output is not a terminal, and the benchmarks' model cache under the data directory."""

from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from lockgate.engine import LLM, SamplingParams, default_group_size
from lockgate.gateway import cli
from tests.support.helpers import FAMILIES, demo_model

runner = CliRunner()


def _commands(group, path: tuple[str, ...] = ()):
    """(path, command) of every command under `group` (Typer's own click classes: groups are
    what has `commands`), groups included."""
    for name, command in group.commands.items():
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def test_help_at_80_columns_keeps_every_option_name_whole():
    root = typer.main.get_command(cli.app)
    checked = 0
    for path, command in _commands(root):
        result = runner.invoke(cli.app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert result.exit_code == 0, (path, result.output)
        assert max(len(line) for line in result.output.splitlines()) <= 80, (path, result.output)
        for param in command.params:
            for name in (*param.opts, *param.secondary_opts):
                if name.startswith("-"):
                    assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), (path, name)
                    checked += 1
    assert checked > 40, checked
    serve = runner.invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "80"}).output
    for flag in ("--max-num-batched-tokens", "--gpu-memory-utilization", "--no-enable-prefix-caching"):
        assert flag in serve


def test_vllm_flags_map_onto_engine_keywords():
    assert cli.engine_flags(max_num_seqs=None, dtype=None) == {}
    assert cli.engine_flags(dtype="half", enable_prefix_caching=False, block_size=32) == {
        "dtype": "float16", "enable_prefix_caching": False, "block_size": 32}
    assert cli.engine_flags(dtype="float")["dtype"] == "float32"
    with pytest.raises(typer.BadParameter, match="power of two"):
        cli.engine_flags(block_size=24)
    with pytest.raises(typer.BadParameter, match="bfloat16"):
        cli.engine_flags(dtype="fp8")
    note = cli._device_note({"gpu_memory_utilization": 0.5}, None)
    import torch

    assert (note is None) == torch.cuda.is_available()
    assert cli._device_note({"max_num_seqs": 4}, None) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_default_group_size_fits_every_demo_model(family):
    for size in ("tiny", "small"):
        gs = default_group_size(demo_model(family, size, 0), "awq")
        assert gs == 64, (family, size, gs)          # 704 = 11 x 64 in the small MLP
        assert default_group_size(demo_model(family, size, 0), "gptq") == 128


def test_quantize_awq_works_with_its_defaults(tmp_path):
    out = tmp_path / "awq"
    result = runner.invoke(cli.app, ["quantize", demo_model("llama", "small", 0), str(out), "--method", "awq"])
    assert result.exit_code == 0, result.output
    assert "group 64" in result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    # an explicit size that leaves a group short: refused, naming the ones that fit
    result = runner.invoke(cli.app, ["quantize", demo_model("llama", "small", 0), str(tmp_path / "x"),
                                     "--method", "awq", "--group-size", "128"])
    assert result.exit_code != 0 and "64 or 32" in result.output and "704" in result.output
    # the tiny one, quantized on its defaults, loads and generates
    result = runner.invoke(cli.app, ["quantize", demo_model("llama", "tiny", 0), str(tmp_path / "t"),
                                     "--method", "awq"])
    assert result.exit_code == 0, result.output
    llm = LLM(model=str(tmp_path / "t"), kv_cache_memory=8 << 20)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0,
                                                        ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_llm_generate_writes_nothing_to_a_stdout_that_is_not_a_terminal(capfd):
    llm = LLM(model=demo_model("llama", "tiny", 0), kv_cache_memory=8 << 20)
    capfd.readouterr()
    outs = llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=2, temperature=0))
    assert len(outs) == 2
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_bench_models_live_under_the_data_dir(tmp_path, monkeypatch):
    from lockgate.loadtests import bench_gateway
    from lockgate.loadtests.cache import cache_dir

    for var in ("LOCKGATE_CACHE_DIR", "LOCKGATE_CACHE", "LOCKGATE_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCKGATE_DATA_DIR", str(tmp_path / "data"))
    assert cache_dir() == tmp_path / "data" / "cache"
    path = bench_gateway.default_model_dir()
    assert path.is_relative_to(tmp_path / "data" / "cache") and (path / "config.json").is_file()
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_quick_start_says_the_demo_model_is_noise_and_how_to_serve_a_checkpoint():
    """Where the README's quick start is, it says the demo model's weights are random (its
    output noise by design) and shows `lockgate serve --model NAME=DIR` on a checkpoint's
    directory, with the files that directory holds; the option is the one `serve` takes."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "random weights" in quick and "noise" in quick
    assert re.search(r"lockgate serve --model \w+=\S+", quick), quick
    for name in ("config.json", "safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in quick, name
    serve = typer.main.get_command(cli.app).commands["serve"]
    assert any("--model" in p.opts and "NAME=DIR" in (p.help or "") for p in serve.params)
