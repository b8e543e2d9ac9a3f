import os

import torch
from hypothesis import settings

torch.manual_seed(0)
torch.set_num_threads(min(2, os.cpu_count() or 1))
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
