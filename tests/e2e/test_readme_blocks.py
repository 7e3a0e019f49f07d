"""The README's Python examples run as printed: every ```python block of "## Calling it"
(its subsections included), in order and in one namespace, against a live `lockgate serve`
of the demo model, with only the README's address swapped for the server's; and the
"## Using the engine" blocks against a demo model directory and a demo LoRA adapter."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import shutil
from pathlib import Path

from tests.support import lora
from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(section: str) -> list[str]:
    """The ```python blocks from the `## {section}` heading up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end != -1 else None]
    return re.findall(r"^```python\n(.*?)^```$", body, flags=re.S | re.M)


def run_blocks(blocks: list[str], ns: dict) -> list[dict]:
    """Each block as a module body (top-level `await` allowed, as a notebook runs it); the
    namespace as each block left it (later blocks reuse names such as `r` and `s`)."""
    after = []
    for i, src in enumerate(blocks):
        code = compile(src, f"<README block {i}>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                       dont_inherit=True)  # not this file's `annotations` future
        result = eval(code, ns)  # noqa: S307 - the README's own code, run as a reader would
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        after.append(dict(ns))
    return after


def test_calling_it_blocks_run_as_printed(tmp_path, monkeypatch, capsys):
    blocks = python_blocks("Calling it")
    assert len(blocks) >= 5, len(blocks)
    work = tmp_path / "work"
    work.mkdir()
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}}
             for i, text in enumerate(("Hello", "Hi"))]
    (work / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with running_server(tmp_path / "srv", "embedded", models={"demo": demo_model()},
                        extra_env={"LOCKGATE_MODEL_ALIASES": json.dumps({"claude-*": "demo"})}) as srv:
        _, key = srv.tenant()
        monkeypatch.setenv("LOCKGATE_KEY", key)
        monkeypatch.chdir(work)
        ns: dict = {"__name__": "__readme__"}
        after = run_blocks([b.replace("http://127.0.0.1:8000", srv.url) for b in blocks], ns)
        output = ns["client"].files.content(ns["b"].output_file_id).text
    # structured outputs and tools: a forced get_weather call, then its result sent back
    tools_block = next(seen for seen in after if "call" in seen)
    assert tools_block["r"].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert ns["call"].function.name == "get_weather"
    assert isinstance(json.loads(ns["call"].function.arguments)["city"], str)
    # Anthropic: a message, and a forced tool_use block from the stream
    assert ns["m"].role == "assistant" and ns["m"].usage.output_tokens > 0
    final = next(seen["s"] for seen in after if "claude" in seen).get_final_message()
    assert [block.name for block in final.content if block.type == "tool_use"] == ["get_weather"], final
    assert final.stop_reason == "tool_use", final
    # Batches: completed, one output line per request
    assert ns["b"].status == "completed", ns["b"]
    assert ns["b"].request_counts.completed == 2, ns["b"].request_counts
    assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == ["req-0", "req-1"]
    # Responses: text back, and a chained response
    assert ns["r"].output_text, ns["r"]
    assert ns["r2"].previous_response_id == ns["r"].id
    assert "req-1" in capsys.readouterr().out   # the batch's results, printed


def test_using_the_engine_blocks_run_as_printed(tmp_path, monkeypatch):
    """LLM, AsyncEngine and the LoRA variant, a demo model for the README's model paths and a
    demo adapter as its `adapters/sql`."""
    blocks = python_blocks("Using the engine")
    assert len(blocks) == 3, len(blocks)
    shutil.copytree(lora.source("pub"), tmp_path / "adapters" / "sql")
    monkeypatch.chdir(tmp_path)
    model = demo_model()
    ns: dict = {"__name__": "__readme__"}
    after = run_blocks([b.replace('"path/to/hf-model-dir"', repr(model)).replace('"base-dir"', repr(model))
                        for b in blocks], ns)
    assert after[0]["outs"][0].outputs[0].token_ids
    outs = ns["outs"]   # the LoRA block's: the adapter's row and the bare base's
    assert len(outs) == 2 and all(o.outputs[0].token_ids for o in outs)
    for out, adapter in zip(outs, (str(lora.source("pub")), None), strict=True):   # greedy, as HF + peft
        tokens = list(out.outputs[0].token_ids)
        assert tokens == lora.peft_greedy(model, adapter, list(out.prompt_token_ids), len(tokens))
