"""A text completion request -> its `Job`: up to 16 prompts, each text (tokenized) or token
ids (checked against the vocabulary), a token budget each, and its choices and stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from lockgate.engine import RequestOutput
from lockgate.gateway import structured
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.protocol import CompletionRequest
from lockgate.gateway.responses import CompletionChoice, Head, chunk, completion_logprobs, sse
from lockgate.gateway.serving.job import Job, RunInputs, chunk_usage
from lockgate.gateway.serving.prepare import max_tokens_for, sampling, tokenizer_error
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import TokenizePool, TokenizerError

MAX_PROMPTS = 16


async def prompt_ids(settings: Settings, tokenize: TokenizePool, req: CompletionRequest,
                     entry: ModelEntry) -> list[list[int]]:
    """Each prompt's token ids; 400 naming the prompt for an empty, long or bad one."""
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
    vocab = entry.info.vocab_size
    out: list[list[int]] = []
    for k, p in enumerate(prompts):
        if isinstance(p, str):
            if len(p) > settings.max_prompt_chars:
                raise APIError(400, f"prompt: longer than {settings.max_prompt_chars} characters", param="prompt")
            try:        # one prompt at a time: a request never holds more than one worker
                ids = await tokenize.encode(entry.info, p)
            except TokenizerError as exc:
                raise tokenizer_error(exc) from None
        else:
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt[{k}]: token ids must be integers in [0, {vocab})", param="prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        out.append(ids)
    return out


async def completion_job(settings: Settings, tokenize: TokenizePool, req: CompletionRequest,
                         entry: ModelEntry) -> Job:
    ids_list = await prompt_ids(settings, tokenize, req, entry)
    spec = await structured.constraint(settings, entry.info, req)
    params_list = []
    reserve = 0
    for ids in ids_list:
        mt = max_tokens_for(settings, entry, len(ids), req.max_tokens, "max_tokens", "prompt")
        sp = sampling(req, mt, req.logprobs, spec)
        params_list.append(sp)
        reserve += len(ids) + mt * sp.n
    n = params_list[0].n
    top = req.logprobs or 0
    inputs = RunInputs(ids_list, params_list, reserve, req.cache_salt, req.priority or 0,
                       req.prompt_cache_key)

    def choices(finals: dict[int, RequestOutput]) -> list[CompletionChoice]:
        return [{"index": i * n + c.index, "text": c.text,
                 "logprobs": completion_logprobs(c, 0, top, 0), "finish_reason": c.finish_reason}
                for i in range(len(ids_list)) for c in finals[i].outputs]

    def chunks(run: RequestRun, h: Head, include_usage: bool) -> AsyncIterator[bytes]:
        return completion_chunks(run, h, top, include_usage, n)

    return Job("completion", inputs, choices, chunks)


async def completion_chunks(run: RequestRun, h: Head, top: int, include_usage: bool, n: int,
                            ) -> AsyncIterator[bytes]:
    sent: dict[tuple[int, int], tuple[int, int]] = {}   # (prompt, choice) -> (tokens, chars)
    ended: set[tuple[int, int]] = set()     # the engine's outputs keep an ended sample: its reason is said once
    async for i, out in run.events():
        for c in out.outputs:
            toks, chars = sent.get((i, c.index), (0, 0))
            if (i, c.index) in ended or not (c.delta_text or c.finish_reason
                                             or (c.logprobs and len(c.token_ids) > toks)):
                continue
            if c.finish_reason is not None:
                ended.add((i, c.index))
            lp = completion_logprobs(c, toks, top, chars)
            sent[(i, c.index)] = (len(c.token_ids), chars + len(c.delta_text))
            choice = CompletionChoice(index=i * n + c.index, text=c.delta_text, logprobs=lp,
                                      finish_reason=c.finish_reason)
            yield sse(chunk("completion", h, [choice], chunk_usage(run, include_usage)))
            run.mark_sent(i, c.index, len(c.token_ids))
