"""Timesteps read from a host copy of the scheduler's timesteps (stage_programs/host_timesteps.py):
the same values as reading each call's tensor, one copy per schedule."""

from __future__ import annotations

import torch

from tokpipe_compiler.stage_programs.host_timesteps import HostTimesteps


def schedule(steps: int = 5) -> torch.Tensor:
    return torch.linspace(999.0, 0.0, steps)


def test_views_of_one_schedule_are_read_from_one_copy():
    reader, timesteps = HostTimesteps(), schedule()
    for t in timesteps:  # as a pipeline's loop: t.expand(batch) each step
        for view in (t.expand(2), t, t.reshape(1)):
            assert reader.value(view) == float(view.max())
    assert reader.value(timesteps[1:3]) == float(timesteps[1:3].max())
    assert reader.copies == 1


def test_a_schedule_written_in_place_is_copied_again():
    reader, timesteps = HostTimesteps(), schedule()
    assert reader.value(timesteps[0].expand(2)) == 999.0
    timesteps.mul_(0.5)  # the version counter moves
    assert reader.value(timesteps[0].expand(2)) == 499.5
    timesteps[1:].fill_(7.0)  # through a view: the same counter
    assert reader.value(timesteps[2].expand(2)) == 7.0
    assert reader.copies == 3


def test_a_new_schedule_is_copied_again():
    reader = HostTimesteps()
    first = schedule()
    assert reader.value(first[0].expand(2)) == 999.0
    del first
    second = schedule() + 1.0  # may reuse the freed memory; the weak reference tells
    assert reader.value(second[0].expand(2)) == 1000.0
    assert reader.copies == 2


def test_what_is_no_view_of_a_schedule_is_read_directly():
    reader, timesteps = HostTimesteps(), schedule()
    assert reader.value(timesteps[2] / 1000) == float(timesteps[2] / 1000)  # a fresh tensor
    assert reader.value(torch.full((2,), 3.0)) == 3.0
    big = torch.arange(10_000.0)
    assert reader.value(big[5].expand(2)) == 5.0  # a base too large to be a schedule
    strided = torch.empty_strided((3,), (2,)).fill_(4.0)  # a base that is not contiguous
    assert reader.value(strided[1:].expand(2, 2)) == 4.0
    with torch.inference_mode():  # no version counter: never copied
        frozen = schedule()
        assert reader.value(frozen[3].expand(2)) == float(frozen[3])
    assert reader.copies == 0
    assert reader.value(torch.empty(0)) is None
    assert reader.value(0.5) == 0.5 and reader.value("t") is None
