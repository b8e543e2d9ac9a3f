"""A parallelized pipeline's ranks compare their schedulers by a fingerprint of the class
and configuration: processes started apart (torchrun's, each with its own string-hash
seed) must spell an equal configuration alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRINT_ENTRY = """
import diffusers
from tokpipe_compiler.stage_programs.agreement import pipeline_entry
scheduler = getattr(diffusers, {name!r}).from_config(getattr(diffusers, {name!r})().config)
print(pipeline_entry(scheduler, ring=True)["scheduler"])
"""


def _entry(name: str, hash_seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    done = subprocess.run([sys.executable, "-c", PRINT_ENTRY.format(name=name)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["FlowMatchEulerDiscreteScheduler",
                                  "DPMSolverMultistepScheduler"])
def test_processes_with_other_hash_seeds_fingerprint_a_scheduler_alike(name):
    entries = {_entry(name, seed) for seed in (1, 2)}
    assert len(entries) == 1, entries


def test_the_fingerprint_tells_configurations_apart():
    from diffusers import DPMSolverMultistepScheduler

    from tokpipe_compiler.stage_programs.agreement import pipeline_entry

    one = pipeline_entry(DPMSolverMultistepScheduler(), ring=True)
    other = pipeline_entry(DPMSolverMultistepScheduler(solver_order=3), ring=True)
    assert one["scheduler"] != other["scheduler"]
