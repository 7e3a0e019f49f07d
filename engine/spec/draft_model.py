"""The draft-model proposer: a smaller model over the target's vocabulary, beside it in the
same runner (vLLM's `speculative_config={"model": DIR, "num_speculative_tokens": k}`).

The draft keeps KV tensors of its own but uses the target's block tables and slot mapping:
the same block ids, the same positions. Allocation, `truncate`, `free` and prefix caching stay
the target's one interface, and the draft's bytes per block are counted in every KV block
(the block count shrinks accordingly), its weights beside the target's; it is loaded,
offloaded and reloaded with the target (ModelRunner.load / offload).

Every step, before the target's forward (`propose`), the draft runs what the target is about
to run, so that its KV is valid wherever the target's is (a prefix-cache hit reuses both):

- forward 0: every scheduled row as the target computes it (prompt chunks, plain decodes), but
  a decode that carries drafts only its last token; the draft's logits there give draft 1;
- forward j = 1..d - 1: each row with d > j drafts feeds draft j at the next position, its
  logits giving draft j + 1.

Draft d itself is never fed in its step: where the target keeps all d, the row's next step
feeds it (forward 0 then starts a token earlier, `fed`); where it keeps fewer, that position is
rejected anyway. One forward fewer a step than feeding it at once; meanwhile that one slot's
draft KV is unwritten (a prefix-cache hit on its block in between would give the hitting row's
draft a wrong entry there: worse proposals, never a wrong token).

The scheduler has already allocated the slots of a drafting row's 1 + d tokens (SpecDecoder's
`placeholder` proposes d slots); `propose` writes the tokens into `SchedulerOutput.drafts` in
place. After verification the target truncates the rejected positions: the draft's KV there
is garbage as the target's is, rewritten when those positions are computed again. The draft's
KV only decides what it proposes, never what is emitted: the target verifies every token.

Greedy rows propose the draft's argmax. Sampled rows draw from the draft's own distribution q
(the row's temperature, top-k, top-p and min-p over the draft's logits) and keep q; after the
target's forward `verify_sampled` runs `rejection_sample` with it (residual max(0, p - q)), so
emitted tokens follow the target's law. A seeded row draws both the draft's token and the
verifier's randomness from generators seeded by (seed, sample index, position) (the draft's
with an index no request uses), so it gives the same tokens on every run; they differ from the
tokens of the same seed without speculation (a draft token kept is the draft's draw).
"""

from __future__ import annotations

from array import array

import torch

from lockgate.engine.config import ModelConfig
from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.kv_cache.device_cache import DeviceKVCache
from lockgate.engine.models import AttentionMetadata, LlamaForCausalLM, build_skeleton, load_model, tensor_bytes
from lockgate.engine.models.loader import packed_weight_bytes
from lockgate.engine.request import SeqStatus, Sequence
from lockgate.engine.sampler import Sampler, SamplerOutput, SampleRow, logprob_entry, seeded_generator
from lockgate.engine.scheduler import SchedulerOutput
from lockgate.engine.spec.verify import draw_randomness, rejection_sample

# the sample index a seeded row's draft draws use: past any request's n, so that the draft's
# noise never equals the verifier's at the same position (they must be independent)
DRAFT_SAMPLE_INDEX = 1 << 40

# one row of a draft forward: (block table, tokens, position of the first)
_Row = tuple[list[int], list[int], int]


class DraftModel:
    """The draft's weights and KV tensors; `propose` and `verify_sampled` run each step."""

    def __init__(self, model_dir: str, max_model_len: int, dtype: torch.dtype, device: torch.device,
                 seed: int) -> None:
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self.cfg = ModelConfig.from_dir(model_dir)
        try:
            self.max_model_len = self.cfg.context_length(max_model_len)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None
        skeleton = build_skeleton(self.cfg, dtype)
        self.weight_bytes = tensor_bytes(skeleton) + packed_weight_bytes(skeleton, device, dtype)
        self.kv = DeviceKVCache(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim,
                                dtype, device)
        self.model: LlamaForCausalLM | None = None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + 1)
        # the step's sampled drafting rows: q [d, V] of each (what its draft tokens were drawn from)
        self.draft_probs: dict[Sequence, torch.Tensor] = {}
        # running rows whose draft KV ends before the target's: how many positions it holds
        # (a row drafted d tokens feeds the last one at its next step, should all be kept)
        self.fed: dict[Sequence, int] = {}

    def bytes_per_block(self, block_size: int) -> int:
        return self.kv.bytes_per_block(block_size)

    def load(self) -> None:
        """The weights (the runner allocates the KV cache after: `allocate`)."""
        if self.model is None:
            self.model = load_model(self.model_dir, self.cfg, self.max_model_len, self.dtype, self.device)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv.allocate(num_blocks, block_size)

    def offload(self) -> None:
        self.model = None
        self.kv.free()

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, kv: KVCacheManager, sampler: Sampler) -> None:
        """Run the draft over the step (see the module's doc): its KV where the target's goes,
        and each drafting row's tokens written into `sched.drafts`."""
        model = self._loaded()
        drafts = sched.drafts
        self.draft_probs = {}
        fed, self.fed = self.fed, {}
        rows: list[_Row] = []
        drafting: list[Sequence] = []
        for seq, num_new in sched.scheduled:
            start = seq.num_computed_tokens
            begin = min(start, fed.pop(seq, start))     # a fully kept draft: its last token first
            n = 1 if seq in drafts else num_new
            rows.append((kv.block_ids(seq), seq.token_ids[begin:start + n], begin))
            if seq in drafts:
                drafting.append(seq)
        self.fed.update({s: e for s, e in fed.items() if s.status is SeqStatus.RUNNING})
        self.fed.update({s: s.num_computed_tokens + len(drafts[s]) for s in drafting})
        logit_rows = [i for i, (seq, _) in enumerate(sched.scheduled) if seq in drafts]
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in drafting}
        for j in range(max([1] + [len(drafts[s]) for s in drafting])):
            if j > 0:
                drafting = [s for s in drafting if len(drafts[s]) > j]
                rows = [(kv.block_ids(s), [drafts[s][j - 1]], s.num_computed_tokens + j) for s in drafting]
                logit_rows = list(range(len(drafting)))
            hidden = self._forward(model, rows)
            if not drafting:
                continue
            logits = model.compute_logits(hidden[_last_positions(rows, logit_rows, hidden.device)])
            if logits is None:
                raise RuntimeError("the draft model is never sharded: it has every logit")
            for seq, token in zip(drafting, self._choose(logits, drafting, j, sampler, probs), strict=True):
                drafts[seq][j] = token
        self.draft_probs = {s: torch.stack(p) for s, p in probs.items() if p}

    def _forward(self, model: LlamaForCausalLM, rows: list[_Row]) -> torch.Tensor:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens = [0], []
        for table, tokens, start in rows:
            pos = range(start, start + len(tokens))
            ids += tokens
            positions.extend(pos)
            slots += [table[p // bs] * bs + p % bs for p in pos]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        width = max(len(t) for t, _, _ in rows)
        flat = [b for t, _, _ in rows for b in t + [0] * (width - len(t))]
        dev = self.device
        meta = AttentionMetadata(slot_mapping=_i64(slots, dev), block_tables=_i64(flat, dev).view(len(rows), width),
                                 seq_lens=_i64(seq_lens, dev), query_start_loc=_i64(starts, dev))
        return model(_i64(ids, dev), _i64(positions, dev), self.kv.layers, meta)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], j: int, sampler: Sampler,
                probs: dict[Sequence, list[torch.Tensor]]) -> list[int]:
        """Draft token j + 1 of each row: the argmax for greedy rows; for sampled rows a draw
        from q (kept in `probs`)."""
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            rows = [SampleRow(seqs[i].params, [], [], seqs[i].index, seqs[i].num_tokens + j) for i in sampled]
            q = sampler.filtered_probs(logits[sampled], rows)
            noise = torch.empty_like(q)
            for r, (i, row) in enumerate(zip(sampled, rows, strict=True)):
                seed = row.params.seed
                g = self.generator if seed is None else \
                    seeded_generator(seed, DRAFT_SAMPLE_INDEX + row.sample_index, row.position, self.device)
                noise[r].exponential_(generator=g)
                probs[seqs[i]].append(q[r])
            chosen[sampled] = (q / noise.clamp_min(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return chosen.tolist()

    def verify_sampled(self, logits: torch.Tensor, seqs: list[Sequence], sample_rows: list[SampleRow],
                       out: SamplerOutput, drafts: dict[Sequence, list[int]], sampler: Sampler) -> None:
        """The sampled drafting rows' tokens by rejection sampling against q: their rows of
        `out` rewritten (later rows of a row's draft than it emits are never read) and their
        acceptance set (`out.accepted_at`, by the row's first sampler row)."""
        first: dict[Sequence, int] = {}
        row = 0
        for seq in seqs:
            first[seq] = row
            row += 1 + len(drafts.get(seq, ()))
        todo = [s for s in seqs if s in self.draft_probs and s in drafts]
        if not todo:
            return
        k = max(len(drafts[s]) for s in todo)
        vocab = logits.shape[1]
        p = torch.zeros(len(todo), k + 1, vocab, device=logits.device)
        q = torch.zeros(len(todo), k, vocab, device=logits.device)
        draft = torch.zeros(len(todo), k, dtype=torch.long, device=logits.device)
        for b, seq in enumerate(todo):
            d, r0 = len(drafts[seq]), first[seq]
            p[b, :d + 1] = sampler.target_probs(logits[r0:r0 + d + 1], sample_rows[r0:r0 + d + 1])
            q[b, :d] = self.draft_probs[seq]
            draft[b, :d] = torch.tensor(drafts[seq])
        num_draft = torch.tensor([len(drafts[s]) for s in todo], device=logits.device)
        randomness = draw_randomness([(s.params.seed, s.index, s.num_tokens) for s in todo], k, vocab,
                                     self.generator, logits.device)
        accepted, tokens = rejection_sample(p, q, draft, num_draft, *randomness)
        for b, seq in enumerate(todo):
            a, r0 = int(accepted[b]), first[seq]
            out.accepted_at[r0] = a
            for j, token in enumerate(tokens[b, :a + 1].tolist()):
                if out.token_ids[r0 + j] != token and out.logprobs[r0 + j] is not None:
                    num = sample_rows[r0 + j].params.logprobs or 0
                    out.logprobs[r0 + j] = logprob_entry(torch.log_softmax(logits[r0 + j].float(), -1), token, num)
                out.token_ids[r0 + j] = token

    def _loaded(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("the draft model is offloaded: load() it before running a step")
        return self.model


def _last_positions(rows: list[_Row], which: list[int], device: torch.device) -> torch.Tensor:
    """Flat indices of the last token of each row in `which`."""
    ends = [0]
    for _, tokens, _ in rows:
        ends.append(ends[-1] + len(tokens))
    return torch.tensor([ends[i + 1] - 1 for i in which], dtype=torch.long, device=device)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    if not values or device.type != "cpu":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.long)
