import os
import shutil

# Triton kernels run on the CPU through the interpreter; the variable must be set before
# anything imports triton (Inductor does), so it is set here, first.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

torch.manual_seed(0)
# Under pytest-xdist (scripts/test.sh) the workers share the cores: one thread each.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // WORKERS))
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`--dist loadgroup`, as scripts/test.sh runs it), a module's tests
    run on one worker, so its shared fixtures (compiled artefacts) are made once; and every
    test that starts gloo ranks (marked `ranks`) runs on one worker, one after another: the
    ranks take the cores, the other workers run one-process tests."""
    for item in items:
        ranks = item.get_closest_marker("ranks") is not None
        item.add_marker(pytest.mark.xdist_group("ranks" if ranks else str(item.fspath)))


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module starts with Dynamo's caches empty. Dynamo compiles one function at
    most 8 times per process and then runs it eagerly; the modules a worker runs build
    many instances of the same model classes, which would add up across modules."""
    torch._dynamo.reset()
    yield
