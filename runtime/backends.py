"""The backend a process group's messages take, however the group was started.

`init_process_group()` with no backend (torchrun's usual call) starts a group whose
`get_backend` is "undefined": gloo for CPU tensors and, where CUDA is there, NCCL for CUDA
tensors; "cpu:gloo" names gloo per device. The transport needs the one its messages take:
gloo's point-to-point waits differ from NCCL's, and NCCL's messages live on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_backend(group: Any = None) -> str:
    """"gloo", "nccl" (or another backend's name): what `group`'s messages between this
    rank's tensors take, NCCL on the GPU where the group has it for CUDA tensors and a
    GPU is there, the CPU's backend otherwise."""
    name = str(dist.get_backend(group))
    if name in ("gloo", "nccl", "mpi"):
        return name
    per_device = dict(part.split(":", 1) for part in
                      str(dist.get_backend_config(group)).split(",") if ":" in part)
    if torch.cuda.is_available() and per_device.get("cuda") == "nccl":
        return "nccl"
    return per_device.get("cpu", name)
