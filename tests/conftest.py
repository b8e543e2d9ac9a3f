import os
import shutil

# Triton kernels run on the CPU through the interpreter; the variable must be set before
# anything imports triton (Inductor does), so it is set here, first.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from hypothesis import settings

torch.manual_seed(0)
torch.set_num_threads(min(2, os.cpu_count() or 1))
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
