"""The speculative verifier (engine/spec/verify.py): greedy acceptance, and rejection sampling
that leaves the output distributed as the target's, whatever the draft proposes.

The statistical test draws N = 200,000 independent rows of one step at once (the rows are the
batch dimension). The target is context-independent: position j has its own distribution p_j,
whatever came before. A token at position j is emitted when the row accepted at least j draft
tokens; which it is then depends only on position j's draft token and random numbers, so the
tokens emitted at position j must be distributed as p_j. With 200,000 rows over 10 to 20
tokens, sampling noise alone gives a total-variation distance of about 0.004 (0.4 sqrt(V / n));
the check is TV <= 0.01. A control verifier that redraws from p instead of the normalized
max(0, p - q) at a rejection shows the test can fail: its first token is off by TV > 0.05.
"""

from __future__ import annotations

import pytest
import torch

from lockgate.engine.sampler import Sampler, SampleRow
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.spec.verify import NOT_EMITTED, accept_greedy, draw_randomness, rejection_sample

NUM_ROWS = 200_000
# (vocabulary, k, seed, proposer): "sampled" draws the draft from its own q (draft_probs
# given); "near" too, with q close to p (most drafts accepted, so the last positions see
# enough rows); "ngram" is deterministic (draft_probs None): a peaked target, the draft its
# top token 80% of the time, else any token
CASES = [
    (10, 1, 0, "sampled"),
    (20, 2, 1, "sampled"),
    (16, 4, 2, "near"),
    (12, 3, 3, "ngram"),
    (20, 4, 4, "near"),
]


def _dirichlet(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    # Gamma(1) is Exp(1): a flat Dirichlet without torch.distributions (which takes no generator)
    x = torch.empty(shape).exponential_(generator=g)
    return x / x.sum(-1, keepdim=True)


def _step(vocab: int, k: int, seed: int, proposer: str, mixed_lengths: bool):
    """One verifier step over NUM_ROWS rows: the per-position target p [k+1,V], and the inputs."""
    g = torch.Generator().manual_seed(seed)
    p = _dirichlet((k + 1, vocab), g)
    q = _dirichlet((k, vocab), g)
    if proposer == "near":
        q = 0.7 * p[:k] + 0.3 * q
    if proposer == "ngram":
        top = torch.randint(0, vocab, (k + 1,), generator=g)
        p = 0.75 * torch.nn.functional.one_hot(top, vocab) + 0.25 * p
        q = 0.8 * torch.nn.functional.one_hot(top[:k], vocab) + 0.2 / vocab   # how the drafts fall, not passed
    draft = torch.stack([torch.multinomial(q[j], NUM_ROWS, replacement=True, generator=g) for j in range(k)], 1)
    num_draft = torch.full((NUM_ROWS,), k)
    if mixed_lengths:   # half the rows propose fewer than k (0 .. k), padded
        short = torch.rand(NUM_ROWS, generator=g) < 0.5
        num_draft[short] = torch.randint(0, k + 1, (int(short.sum()),), generator=g)
    draft = torch.where(torch.arange(k)[None] < num_draft[:, None], draft, NOT_EMITTED)
    inputs = dict(
        target_probs=p.expand(NUM_ROWS, k + 1, vocab),
        draft_probs=None if proposer == "ngram" else q.expand(NUM_ROWS, k, vocab),
        draft=draft,
        num_draft=num_draft,
        uniforms=torch.rand(NUM_ROWS, k, generator=g),
        residual_noise=torch.empty(NUM_ROWS, k + 1, vocab).exponential_(generator=g),
    )
    return p, inputs


def _resample_from_p(**inputs):
    """The control: the same acceptance test, but a rejection redraws from p itself."""
    accepted, tokens = rejection_sample(**inputs)
    p, noise = inputs["target_probs"], inputs["residual_noise"]
    redrawn = (p / noise).argmax(dim=2).gather(1, accepted[:, None]).squeeze(1)
    tokens[torch.arange(len(accepted)), accepted] = redrawn
    return accepted, tokens


def _tv_per_position(p: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor) -> list[tuple[float, int]]:
    """(TV to p_j, rows emitting a token there) for each position j."""
    out = []
    for j in range(p.shape[0]):
        emitted = tokens[accepted >= j, j]
        assert (emitted != NOT_EMITTED).all() and (tokens[accepted < j, j] == NOT_EMITTED).all()
        freq = torch.bincount(emitted, minlength=p.shape[1]).double() / max(len(emitted), 1)
        out.append((0.5 * float((freq - p[j].double()).abs().sum()), len(emitted)))
    return out


@pytest.mark.parametrize("mixed_lengths", [False, True], ids=["full", "mixed"])
@pytest.mark.parametrize(("vocab", "k", "seed", "proposer"), CASES)
def test_rejection_sampling_emits_the_targets_distribution(vocab, k, seed, proposer, mixed_lengths):
    p, inputs = _step(vocab, k, seed, proposer, mixed_lengths)
    accepted, tokens = rejection_sample(**inputs)
    assert (accepted <= inputs["num_draft"]).all()
    kept = torch.arange(k)[None] < accepted[:, None]
    assert torch.equal(tokens[:, :k][kept], inputs["draft"][kept])
    tvs = _tv_per_position(p, accepted, tokens)
    print(f"\nV={vocab} k={k} {proposer} {'mixed' if mixed_lengths else 'full'}: "
          + ", ".join(f"pos {j}: TV {tv:.4f} over {n}" for j, (tv, n) in enumerate(tvs)))
    for j, (tv, n) in enumerate(tvs):
        # a position fewer rows reach gets the same test at its own noise level: 0.01 at
        # 100,000 rows, scaled as sampling noise is (1 / sqrt(n)); at least 20,000 rows
        assert n >= 20_000, f"position {j}: only {n} rows emit a token there"
        bound = 0.01 * max(1.0, (100_000 / n) ** 0.5)
        assert tv <= bound, f"position {j}: TV {tv:.4f} over {n} rows, bound {bound:.4f}"


@pytest.mark.parametrize(("vocab", "k", "seed", "proposer"), [c for c in CASES if c[3] != "near"])
def test_control_redrawing_from_p_is_caught(vocab, k, seed, proposer):
    p, inputs = _step(vocab, k, seed, proposer, mixed_lengths=False)
    tvs = _tv_per_position(p, *_resample_from_p(**inputs))
    print(f"\ncontrol V={vocab} k={k} {proposer}: "
          + ", ".join(f"pos {j}: TV {tv:.4f} over {n}" for j, (tv, n) in enumerate(tvs)))
    assert tvs[0][0] > 0.05


def test_accept_greedy_takes_the_matching_prefix():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    draft = torch.tensor([
        [5, 6, 7],      # all three match: the bonus token 8 follows
        [5, 9, 7],      # a mismatch at 1: a later match does not count
        [9, 6, 7],      # a mismatch at 0: only the target's own token
        [5, 6, -1],     # two real, one padding: both kept, then the target's 7
        [1, 2, 3],      # no draft at all (num_draft 0): matching padding is ignored
    ])
    num_draft = torch.tensor([3, 3, 3, 2, 0])
    accepted, tokens = accept_greedy(draft, target, num_draft)
    assert accepted.tolist() == [3, 1, 0, 2, 0]
    assert torch.equal(tokens, target)
    emitted = [tokens[b, : a + 1].tolist() for b, a in enumerate(accepted.tolist())]
    assert emitted == [[5, 6, 7, 8], [5, 6], [5], [5, 6, 7], [1]]


def test_accept_greedy_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="draft"):
        accept_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]))


def test_one_hot_target_keeps_or_corrects_the_draft():
    """With p one-hot (a greedy target), sampling acts as greedy: accepted exactly where the
    draft has the target's token, and the target's token at the first mismatch."""
    vocab = 7
    target = torch.tensor([[3, 4, 5], [3, 4, 5]])
    probs = torch.nn.functional.one_hot(target, vocab).float()
    draft = torch.tensor([[3, 1], [3, 4]])
    g = torch.Generator().manual_seed(0)
    accepted, tokens = rejection_sample(probs, None, draft, torch.tensor([2, 2]),
                                        torch.rand(2, 2, generator=g),
                                        torch.empty(2, 3, vocab).exponential_(generator=g))
    assert accepted.tolist() == [1, 2]
    assert tokens.tolist() == [[3, 4, NOT_EMITTED], [3, 4, 5]]


def test_seeded_rows_draw_the_same_whatever_the_batch():
    """A seeded row's random numbers depend on (seed, sample index, position) only; the same
    inputs give the same tokens; and with no draft the row samples the token the sampler would."""
    vocab, k = 11, 3
    probs = _dirichlet((1, k + 1, vocab), torch.Generator().manual_seed(5))
    alone = draw_randomness([(42, 0, 17)], k, vocab, torch.Generator().manual_seed(1), torch.device("cpu"))
    batch = draw_randomness([(None, 0, 3), (42, 0, 17), (42, 1, 17)], k, vocab,
                            torch.Generator().manual_seed(2), torch.device("cpu"))
    assert torch.equal(alone[0][0], batch[0][1]) and torch.equal(alone[1][0], batch[1][1])
    assert not torch.equal(batch[1][1], batch[1][2])      # another sample index draws otherwise
    draft, num = torch.tensor([[1, 2, 3]]), torch.tensor([3])
    first = rejection_sample(probs, None, draft, num, *alone)
    again = rejection_sample(probs, None, draft, num, *draw_randomness(
        [(42, 0, 17)], k, vocab, torch.Generator().manual_seed(9), torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    sampler_tokens = set()
    for position in range(17, 27):
        u, noise = draw_randomness([(42, 0, position)], k, vocab, torch.Generator(), torch.device("cpu"))
        _, tokens = rejection_sample(probs, None, draft, torch.tensor([0]), u, noise)
        row = SampleRow(SamplingParams(temperature=1.0, seed=42), [1], [], 0, position)
        plain = Sampler(0, torch.device("cpu"))(probs[0, :1].log(), [row]).token_ids[0]
        assert int(tokens[0, 0]) == plain
        sampler_tokens.add(plain)
    assert len(sampler_tokens) > 1                         # the positions did draw differently
