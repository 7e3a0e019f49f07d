"""A chat completion request -> its `Job`: the chat template rendered and tokenized (tools
included), the token budget, the grammar its structured output or forced tool call needs,
and its choices and stream (content deltas, or tool calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from lockgate.engine import RequestOutput
from lockgate.gateway import structured
from lockgate.gateway.auto_calls import AutoCallReader
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.protocol import ChatCompletionRequest
from lockgate.gateway.responses import ChatChoice, ChatChunkChoice, Head, chat_logprobs, chunk, sse
from lockgate.gateway.serving.job import Job, RunInputs, chunk_usage
from lockgate.gateway.serving.prepare import max_tokens_for, sampling, tokenizer_error
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import TokenizePool, TokenizerError
from lockgate.gateway.tool_calls import ToolCallReader, ToolPlan, chat_message, prompt_messages, tool_plan


async def chat_job(settings: Settings, tokenize: TokenizePool, req: ChatCompletionRequest,
                   entry: ModelEntry) -> Job:
    info = entry.info
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages, tools = prompt_messages(req.messages, plan, info.tokenizer.template_renders_tools)
    if sum(len(m["content"]) for m in messages) > settings.max_prompt_chars:
        raise APIError(400, f"messages: longer than {settings.max_prompt_chars} characters", param="messages")
    try:    # off the event loop when large; special tokens in the messages tokenized as text
        ids = await tokenize.chat_prompt_ids(info, messages, tools, options=req.template_options())
    except TokenizerError as exc:
        raise tokenizer_error(exc) from None
    except Exception as exc:  # noqa: BLE001 - a template's own error is the client's input
        raise APIError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
    max_tokens = max_tokens_for(settings, entry, len(ids), req.requested_max_tokens(),
                                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                                "messages")
    top = req.top_logprobs or 0
    spec = await structured.constraint(settings, info, req, plan)
    params = sampling(req, max_tokens, top if req.logprobs else None, spec)
    inputs = RunInputs([ids], [params], len(ids) + max_tokens * params.n, req.cache_salt, req.priority or 0,
                       req.prompt_cache_key)

    def choices(finals: dict[int, RequestOutput]) -> list[ChatChoice]:
        out: list[ChatChoice] = []
        for c in finals[0].outputs:
            message, finish_reason = chat_message(c.text, c.finish_reason, plan)
            out.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c, 0, top),
                        "finish_reason": finish_reason})
        return out

    def chunks(run: RequestRun, h: Head, include_usage: bool) -> AsyncIterator[bytes]:
        return chat_chunks(run, h, top, include_usage, params.n, plan)

    return Job("chat", inputs, choices, chunks)


async def chat_chunks(run: RequestRun, h: Head, top: int, include_usage: bool, n: int,
                      plan: ToolPlan | None = None) -> AsyncIterator[bytes]:
    """Content deltas; or, when the answer is forced to be tool calls, `delta.tool_calls`
    (each call's id and name, then pieces of its arguments) and finish_reason "tool_calls";
    under `auto`, content with the calls read out of it, each whole once recognized."""
    readers = [ToolCallReader() for _ in range(n)] if plan is not None and plan.forced else None
    autos = ([AutoCallReader(plan.names, plan.auto_max_calls) for _ in range(n)]
             if plan is not None and plan.auto else None)
    sent_tokens = [0] * n
    ended = [False] * n      # the engine's outputs keep an ended sample: its reason is said once
    for i in range(n):
        first = ChatChunkChoice(index=i, delta={"role": "assistant", "content": None if readers else ""},
                                logprobs=None, finish_reason=None)
        yield sse(chunk("chat", h, [first], chunk_usage(run, include_usage)))
    async for _, out in run.events():
        for c in out.outputs:
            if ended[c.index] or not (c.delta_text or c.finish_reason
                                      or (c.logprobs and len(c.token_ids) > sent_tokens[c.index])):
                continue
            ended[c.index] = c.finish_reason is not None
            lp = chat_logprobs(c, sent_tokens[c.index], top)
            sent_tokens[c.index] = len(c.token_ids)
            delta, finish_reason = {"content": c.delta_text} if c.delta_text else {}, c.finish_reason
            if readers is not None:
                calls = readers[c.index].feed(c.delta_text)
                delta = {"tool_calls": calls} if calls else {}
                if finish_reason == "stop" and readers[c.index].calls:
                    finish_reason = "tool_calls"
            elif autos is not None:
                delta, finish_reason = auto_delta(autos[c.index], c.delta_text, finish_reason)
            if (readers or autos) and not (delta or finish_reason or (lp and lp["content"])):
                continue
            choice = ChatChunkChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish_reason)
            yield sse(chunk("chat", h, [choice], chunk_usage(run, include_usage)))
            run.mark_sent(0, c.index, len(c.token_ids))


def auto_delta(reader: AutoCallReader, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """Under `auto`: the delta of what `text` settles (held-back text released at the end)."""
    before = len(reader.calls)
    events = reader.feed(text) + (reader.finish() if finish_reason else [])
    delta: dict = {}
    content = "".join(v for kind, v in events if kind == "content")
    if content:
        delta["content"] = content
    calls = [{"index": before + k, **v} for k, v in enumerate(v for kind, v in events if kind == "call")]
    if calls:
        delta["tool_calls"] = calls
    if finish_reason == "stop" and reader.calls:
        finish_reason = "tool_calls"
    return delta, finish_reason
