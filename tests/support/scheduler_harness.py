"""The scheduler tests' harness (not an engine a server could hold: for that, see
tests/support/fake_served_engine.py): Scheduler + KVCacheManager driven as EngineCore drives
them, with a model runner whose every sampled token is 7. Shared by test_scheduler.py,
test_fairness.py and test_step_sizing.py."""

from __future__ import annotations

from lockgate.engine.config import EngineConfig
from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.request import EngineRequest, RequestState, Sequence
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.scheduler import Scheduler

CLASSES = ("priority", "online", "offline")   # the engine's default classes


class SchedulerHarness:
    """Drives Scheduler + KVCacheManager as EngineCore does, minus the model."""

    def __init__(self, tmp_path, *, num_blocks, block_size=4, **kwargs):
        cfg = EngineConfig(model=str(tmp_path), block_size=block_size, **kwargs)
        self.cfg = cfg
        self.kv = KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching, num_tiers=len(CLASSES))
        self.sched = Scheduler(cfg, self.kv)
        self.n = 0

    def add(self, prompt_len, max_tokens=4, *, cls="online", n=1, prompt=None, priority=0,
            tenant="default", weight=None, share_group=None, lora=None):
        req = EngineRequest(f"r{self.n}", prompt or list(range(100 + self.n * 1000, 100 + self.n * 1000 + prompt_len)),
                            SamplingParams(max_tokens=max_tokens, n=n), service_class=cls, priority=priority,
                            tenant=tenant, tenant_weight=weight, share_group=share_group, lora_request=lora)
        self.n += 1
        state = RequestState(req=req, class_rank=CLASSES.index(cls))
        for i in range(n):
            state.seqs.append(Sequence(state, i, list(req.prompt_token_ids), len(req.prompt_token_ids)))
        self.sched.add(state)
        return state

    def step(self):
        out = self.sched.schedule()
        self.check(out)
        self.sched.update(out)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                # as EngineCore: a sequence stops when it fills the whole cache
                if (seq.num_output_tokens >= seq.params.max_tokens
                        or seq.num_tokens >= self.kv.pool.num_blocks * self.kv.block_size):
                    self.sched.finish(seq, "length")
        return out

    def check(self, out):
        self.sched.check_invariants(out)     # the same check EngineCore runs in tests

    def run(self, max_steps=10_000):
        steps = []
        while self.sched.has_work and len(steps) < max_steps:
            steps.append(self.step())
        assert not self.sched.has_work, "did not finish"
        assert self.kv.num_used_blocks == 0
        return steps


def names(out):
    return [(s.state.request_id, n) for s, n in out.scheduled]
