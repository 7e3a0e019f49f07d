"""The engine's intra-op thread count follows the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.threads import ThreadGovernor, cpus_busy_s, governor_for
from tests.support.helpers import demo_model


class Machine:
    """Readings a governor takes: the clock, the CPUs' busy seconds, this process's CPU."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def _governor(m: Machine, calls: list[int]) -> ThreadGovernor:
    return ThreadGovernor(4, cpus={0, 1, 2, 3}, window_s=0.5, confirm=2, read_busy=lambda: m.busy,
                          read_own=lambda: m.own, set_threads=calls.append, clock=lambda: m.t)


def test_a_neighbour_taking_cores_shrinks_the_width_and_its_leaving_restores_it():
    m, calls = Machine(), []
    g = _governor(m, calls)
    g.tick()
    for _ in range(3):                       # alone: full width, nothing set
        m.run(0.6, own_cores=4, other_cores=0)
        assert g.tick() == 4
    m.run(0.6, own_cores=2, other_cores=2)   # two cores taken: one window is not enough
    assert g.tick() == 4
    m.run(0.6, own_cores=2, other_cores=2)
    assert g.tick() == 2 and calls == [2]
    assert g.stats().others_cores == pytest.approx(2.0)
    m.run(0.6, own_cores=1, other_cores=2.8)  # nearly three taken
    g.tick()
    m.run(0.6, own_cores=1, other_cores=2.8)
    assert g.tick() == 1                      # never below one
    m.run(0.6, own_cores=1, other_cores=0)
    g.tick()
    m.run(0.6, own_cores=1, other_cores=0)
    assert g.tick() == 4 and calls == [2, 1, 4]
    assert g.stats().changes == 3


def test_one_burst_does_not_change_the_width_and_ticks_within_a_window_read_nothing():
    m, calls = Machine(), []
    reads = []
    g = ThreadGovernor(2, cpus={0, 1}, read_busy=lambda: reads.append(1) or m.busy, read_own=lambda: m.own,
                       set_threads=calls.append, clock=lambda: m.t)
    g.tick()
    m.run(0.6, 1, 1)      # a burst
    g.tick()
    m.run(0.6, 2, 0)      # gone
    g.tick()
    m.run(0.1, 2, 0)
    g.tick()              # within the window: no read
    assert calls == [] and len(reads) == 3


def test_a_narrower_width_whose_steps_measure_faster_is_kept_until_it_no_longer_is():
    """Cores all free, yet one thread runs this load's steps faster (a second one waits on the
    process's own other work): a probe finds it and keeps it; once the wider steps are faster
    again, the next probe goes back. A steady load pays for few probes."""
    m, calls = Machine(), []
    g = ThreadGovernor(2, cpus={0, 1}, window_s=0.5, confirm=2, read_busy=lambda: m.busy,
                       read_own=lambda: m.own, set_threads=calls.append, clock=lambda: m.t)
    step_s = {1: 0.005, 2: 0.008}
    widths = []

    def run(seconds: float) -> None:
        end = m.t + seconds
        while m.t < end:
            w = g.tick()
            widths.append(w)
            m.run(step_s[w], own_cores=w, other_cores=0)
            g.observe(step_s[w])

    run(1.0)
    assert set(widths) == {2} and calls == []          # no probe before the first interval
    run(2.0)
    assert g.threads == 1 and g.narrow and g.base == 2
    assert calls[:4] == [1, 2, 1, 2] and calls[-1] == 1   # the probe alternated, then kept one
    widths.clear()
    run(120.0)                                           # steady: probes back off
    assert widths.count(2) / len(widths) < 0.01 and g.threads == 1
    step_s.update({1: 0.006, 2: 0.003})                  # the second thread pays again
    run(140.0)
    assert g.threads == 2 and not g.narrow
    assert g.stats().changes == 0                        # the free cores never changed


def test_a_probe_whose_narrow_steps_are_all_clearly_slower_ends_early():
    """Large steps, where the second thread pays: the probe stops after its first pairs."""
    from lockgate.engine.threads import PROBE_EARLY

    m, calls = Machine(), []
    g = ThreadGovernor(2, cpus={0, 1}, window_s=0.5, confirm=2, read_busy=lambda: m.busy,
                       read_own=lambda: m.own, set_threads=calls.append, clock=lambda: m.t)
    step_s = {1: 0.06, 2: 0.04}
    widths = []
    while m.t < 3.5:
        w = g.tick()
        widths.append(w)
        m.run(step_s[w], own_cores=w, other_cores=0)
        g.observe(step_s[w])
    assert widths.count(1) == PROBE_EARLY and g.threads == 2 and not g.narrow


def test_probes_pair_like_with_like_and_stop_for_a_second_engine():
    """Steps that slow down as a batch fills up favour neither width (pairs narrow-wide, then
    wide-narrow); a second engine's steps would pair with the first's, so probing stops."""
    m, calls = Machine(), []
    g = ThreadGovernor(2, cpus={0, 1}, window_s=0.5, confirm=2, read_busy=lambda: m.busy,
                       read_own=lambda: m.own, set_threads=calls.append, clock=lambda: m.t)
    one, other = object(), object()
    step = 0.004
    while m.t < 6.0:                 # the same cost at either width, 6% more each step
        w = g.tick()
        m.run(step, own_cores=w, other_cores=0)
        g.observe(step, one)
        step *= 1.06
    assert 1 in calls and not g.narrow and g.threads == 2
    g.observe(0.004, other)
    assert not g.probing and g.tick() == 2
    for _ in range(2000):
        w = g.tick()
        m.run(0.004, own_cores=w, other_cores=0)
        g.observe(0.002 if w == 1 else 0.004, one)
    assert g.threads == 2 and not g.narrow


def test_a_fixed_thread_count_is_an_override_the_governor_never_touches():
    old = torch.get_num_threads()
    try:
        g = governor_for(1, 1, torch.device("cpu"))
        assert torch.get_num_threads() == 1 and not g.enabled and g.stats() is None
        assert not governor_for(None, 2, torch.device("cpu")).enabled   # ranks share the cores
    finally:
        torch.set_num_threads(old)


def test_proc_stat_reads_the_affinity_cpus_only(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  300 0 30 600 6 0 0 0 0 0\ncpu0 100 0 10 200 2 0 0 0 0 0\n"
                    "cpu1 200 0 20 400 4 0 0 5 0 0\nintr 1 2 3\n")
    tick = cpus_busy_s({1}, str(stat)) * 100    # in clock ticks at 100 Hz (the usual)
    assert tick == pytest.approx(225 * 100 / os.sysconf("SC_CLK_TCK"))
    assert cpus_busy_s({7}, str(stat)) is None
    assert cpus_busy_s({0}, str(tmp_path / "missing")) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_engine_beside_a_cpu_burner_narrows_then_returns_to_full_width(monkeypatch):
    """A real engine and a real process burning one core: its width shrinks while the burner
    runs and comes back after it stops."""
    monkeypatch.setenv("LOCKGATE_ADAPTIVE_THREADS", "1")
    import lockgate.engine.threads as threads

    cpus = os.sched_getaffinity(0)
    b0, t0 = cpus_busy_s(cpus), time.monotonic()
    time.sleep(1.0)
    others = (cpus_busy_s(cpus) - b0) / (time.monotonic() - t0)
    if others > 0.4 and os.environ.get("CI") != "true":
        pytest.skip(f"the machine is busy already ({others:.2f} cores): the burner's core would not show")

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "_shared", ThreadGovernor(2, window_s=0.2, confirm=2))
    llm = LLM(demo_model(), max_num_seqs=4, seed=0)
    gov = llm.engine.threads
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def drive_until(width: int, budget_s: float) -> bool:
        end = time.monotonic() + budget_s
        while time.monotonic() < end:
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, params, use_tqdm=False)
            if gov.threads == width:
                return True
        return False

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert gov.enabled and gov.max_threads == 2
        assert drive_until(1, 20.0), f"still {gov.threads} threads beside the burner ({gov.stats()})"
        assert torch.get_num_threads() == 1
    finally:
        burner.kill()
        burner.wait(10)
    try:
        assert drive_until(2, 20.0), f"still {gov.threads} threads once the burner stopped ({gov.stats()})"
        assert torch.get_num_threads() == 2
        assert llm.engine.stats().threads.changes >= 2
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(old)
