"""Checksums of a ring's per-step values read each step's view from one host copy of its
table (`agreement.HostViews`): the same values as the views, one copy per table."""

from __future__ import annotations

import torch

from tokpipe_compiler.stage_programs.agreement import HostViews


def test_each_view_reads_its_own_values_from_one_copy_of_the_table():
    table = torch.arange(60.0).reshape(5, 3, 4)
    views = [table[k] for k in range(5)] + [table[1:3, :, ::2], table.transpose(1, 2)[4]]
    host = HostViews(host_too=True)
    read = [host.of(v) for v in views]
    assert all(torch.equal(r, v) for r, v in zip(read, views, strict=True))
    assert len(host._bases) == 1


def test_a_view_of_a_base_that_starts_inside_its_storage():
    storage = torch.arange(100.0)
    base = torch.empty(0).set_(storage.untyped_storage(), 10, (60,))  # no view, offset 10
    assert base._base is None and base.storage_offset() == 10
    rows = base.view(6, 10)
    host = HostViews(host_too=True)
    assert torch.equal(host.of(rows[2]), rows[2])
    assert torch.equal(host.of(rows[:, 3]), rows[:, 3])


def test_a_view_as_another_dtype_is_read_as_itself():
    table = torch.randn(4, 3, 2)
    complex_view = torch.view_as_complex(table)
    assert torch.equal(HostViews(host_too=True).of(complex_view), complex_view)


def test_tensors_that_are_no_views_or_on_the_host_pass_through():
    value = torch.ones(3)
    assert HostViews(host_too=True).of(value) is value
    view = torch.ones(4, 2)[1]
    assert HostViews().of(view) is view  # on the host already: nothing to copy
