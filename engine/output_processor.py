"""From sampled tokens to `RequestOutput`s: appending each sequence's token, the stop
conditions (EOS, stop ids, stop strings, max_tokens, the context its class may use, a
grammar's end), incremental detokenization, logprobs, and the cumulative outputs with their
deltas."""

from __future__ import annotations

import logging

from lockgate.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lockgate.engine.request import RequestState, SeqStatus, Sequence
from lockgate.engine.sampler import SamplerOutput
from lockgate.engine.scheduler import Scheduler
from lockgate.engine.tokenizer import Tokenizer

# prompt tokens the detokenizer starts from, so the first output token is decoded in context
# (a SentencePiece word-start space, a character split across the prompt's end)
DETOKENIZE_CONTEXT = 8

logger = logging.getLogger(__name__)


class OutputProcessor:
    """One model's output side. `eos_token_ids` is shared with the core (callers may edit
    it); a sequence stops at `max_seq_len_by_rank[class rank]` tokens."""

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, eos_token_ids: set[int],
                 max_seq_len_by_rank: list[int]) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_seq_len_by_rank = max_seq_len_by_rank
        self.num_generated_tokens = 0

    def start(self, seq: Sequence) -> None:
        """Ready a new sequence's detokenizer (and its logprobs, when asked for)."""
        req = seq.state.req
        context = req.prompt_token_ids[-DETOKENIZE_CONTEXT:]
        # a context that ends inside a character is cut before it: the stream would emit the
        # whole context again once an output token completed that character
        while context and self.tokenizer.decode(context, False).endswith("\ufffd"):
            context = context[:-1]
        seq.decode_stream = self.tokenizer.decode_stream(req.sampling.skip_special_tokens, context)
        if req.sampling.logprobs is not None:
            seq.logprobs = []

    def append_tokens(self, seqs: list[Sequence], out: SamplerOutput, now: float,
                      touched: dict[str, RequestState]) -> None:
        """Append each sequence's sampled token and finish those that stop; every request
        touched lands in `touched`. A sequence may come several times in a row (speculative
        decoding: the drafts it kept, then its own token): tokens after its stop are dropped."""
        for seq, token, lp in zip(seqs, out.token_ids, out.logprobs, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue
            state = seq.state
            touched[state.request_id] = state
            if state.first_token_time is None:
                state.first_token_time = now
            seq.token_ids.append(token)
            self.num_generated_tokens += 1
            if lp is not None:
                self._record_logprobs(seq, token, lp)
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if seq.grammar is not None and self._grammar_ends(seq, token):
            return
        p = seq.state.req.sampling
        num_out = len(seq.token_ids) - seq.num_prompt_tokens   # runs per token: no properties
        may_stop = num_out > p.min_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._flush_text(seq, num_out - 1)
            self.scheduler.finish(seq, "stop")
            return
        if may_stop and p.stop_token_ids and token in p.stop_token_ids:
            self._flush_text(seq, num_out - 1)
            self.scheduler.finish(seq, "stop", token)
            return
        stream = seq.decode_stream
        if stream is None:
            raise RuntimeError(f"{seq.seq_id}: no detokenizer, the sequence was never started")
        delta = self.tokenizer.step_stream(stream, token)
        if delta:
            seq.text += delta
            seq.num_text_tokens = num_out
            if p.stop_strings and may_stop and self._check_stop_strings(seq, len(delta)):
                return
        if (p.max_tokens is not None and num_out >= p.max_tokens) or (
            len(seq.token_ids) >= self.max_seq_len_by_rank[seq.state.class_rank]
        ):
            self._flush_text(seq, num_out)
            self.scheduler.finish(seq, "length")

    def _grammar_ends(self, seq: Sequence, token: int) -> bool:
        """Advance the sequence's grammar by `token`; True when that ended the sequence: an
        end-of-sequence token (the mask allows one only where the grammar is complete), or a
        token after which the grammar allows nothing more. Either way the finish is "stop",
        min_tokens and ignore_eos notwithstanding: no further token could be valid."""
        grammar = seq.grammar
        if grammar is None:
            return False
        if token in self.eos_token_ids and grammar.is_accepting():
            self._flush_text(seq, seq.num_output_tokens - 1)
            self.scheduler.finish(seq, "stop")
            return True
        if not grammar.consume_token(token):
            # cannot happen for a token drawn under the grammar's mask
            logger.error("%s: token %d refused by its grammar: %s", seq.seq_id, token, grammar.get_error())
            self._flush_text(seq, seq.num_output_tokens)
            self.scheduler.finish(seq, "abort", "grammar")
            return True
        if grammar.is_stopped():
            self._flush_text(seq, seq.num_output_tokens)
            self.scheduler.finish(seq, "stop")
            return True
        return False

    def _flush_text(self, seq: Sequence, upto: int) -> None:
        """At the end, the bytes the incremental decoder still holds (a character cut short)
        are decoded as the full decode would render them (U+FFFD), so the final text equals
        `tokenizer.decode(output ids)`."""
        if upto > seq.num_text_tokens:
            pending = seq.output_token_ids[seq.num_text_tokens:upto]
            seq.text += self.tokenizer.decode(pending, seq.params.skip_special_tokens)
            seq.num_text_tokens = upto

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        p = seq.params
        longest = max(len(s) for s in p.stop_strings)
        window_start = max(0, len(seq.text) - delta_len - longest + 1)
        best = None
        for stop in p.stop_strings:
            idx = seq.text.find(stop, window_start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        seq.text = seq.text[: idx + len(stop)] if p.include_stop_str_in_output else seq.text[:idx]
        self.scheduler.finish(seq, "stop", stop)
        return True

    def _record_logprobs(self, seq: Sequence, token: int, lp: tuple) -> None:
        if seq.logprobs is None:
            raise RuntimeError(f"{seq.seq_id}: logprobs sampled for a sequence that did not ask for them")
        chosen, rank, top = lp
        seq.cumulative_logprob += chosen
        entry = {token: Logprob(chosen, rank, self.tokenizer.decode([token], False))}
        for i, (tid, val) in enumerate(top):
            if tid not in entry:
                entry[tid] = Logprob(val, i + 1, self.tokenizer.decode([tid], False))
        seq.logprobs.append(entry)

    def output(self, state: RequestState) -> RequestOutput:
        """The request's cumulative output; each completion's delta is what is new since the
        last output (text that could still start a stop string held back)."""
        completions = [self._completion(seq) for seq in state.seqs]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.req.prompt,
            prompt_token_ids=state.req.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=state.first_scheduled_time,
                first_token_time=state.first_token_time,
                finished_time=state.finished_time,
                num_preemptions=sum(s.num_preemptions for s in state.seqs),
            ),
        )

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        text = seq.text
        if seq.status is not SeqStatus.FINISHED and seq.params.stop_strings:
            # hold back what could still turn out to be the start of a stop string
            hold = max(len(s) for s in seq.params.stop_strings) - 1
            text = text[: max(seq.num_sent_chars, len(text) - hold)]
        out_ids = seq.output_token_ids
        completion = CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=out_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=text[seq.num_sent_chars:],
            delta_token_ids=out_ids[seq.num_sent_tokens:],
        )
        seq.num_sent_chars = len(text)
        seq.num_sent_tokens = len(out_ids)
        return completion
