"""The CPU thread governor (engine/loading.ThreadGovernor): one thread while the process's threads wait
descheduled, the full count again after a probe."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.loading import ThreadGovernor


class FakeTimes:
    """A clock and a process CPU clock that each step advances by its wall time and the CPU time the process got."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.step_wall, self.share = 0.0, 1.0

    def clock(self) -> float:
        return self.wall

    def cpu_time(self) -> float:
        return self.cpu

    def run(self) -> str:
        self.wall += self.step_wall
        self.cpu += self.step_wall * self.share * torch.get_num_threads()
        return "result"


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def steps(governor: ThreadGovernor, times: FakeTimes, seconds: float, share: float) -> None:
    """Steps of 10 ms for `seconds`, the process getting `share` of what its threads could use."""
    times.step_wall, times.share = 0.01, share
    for _ in range(round(seconds / times.step_wall)):
        assert governor.step(times.run) == "result"


def test_threads_that_wait_descheduled_drop_to_one_and_come_back_after_a_probe(two_threads):
    times = FakeTimes()
    governor = ThreadGovernor(2, clock=times.clock, cpu_time=times.cpu_time)
    steps(governor, times, 2.0, share=0.95)  # the threads get their cores
    assert torch.get_num_threads() == 2
    steps(governor, times, 1.0, share=0.5)  # another process takes half of them
    assert torch.get_num_threads() == 1
    steps(governor, times, ThreadGovernor.PROBE_S - 1.0, share=1.0)
    assert torch.get_num_threads() == 1
    steps(governor, times, 1.5, share=1.0)  # the probe: the full count again
    assert torch.get_num_threads() == 2
    steps(governor, times, 1.0, share=0.95)  # the other process has gone: it stays
    assert torch.get_num_threads() == 2


def test_a_failing_step_still_counts_and_raises(two_threads):
    times = FakeTimes()
    governor = ThreadGovernor(2, clock=times.clock, cpu_time=times.cpu_time)

    def fails():
        times.wall += 1.0
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        governor.step(fails)
    assert torch.get_num_threads() == 1  # a second of wall time with no CPU time: the window closed low


def test_only_an_engine_on_a_cpu_with_threads_of_its_own_choosing_gets_one(two_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert ThreadGovernor.for_device(torch.device("cpu")) is not None
    assert ThreadGovernor.for_device(torch.device("cuda")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ThreadGovernor.for_device(torch.device("cpu")) is None
