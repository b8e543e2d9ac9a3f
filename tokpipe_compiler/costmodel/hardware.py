"""Spec-sheet presets of accelerators and links, for planning and simulation."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch

from tokpipe_compiler.costmodel.calibrate import DeviceRates

# Presets run dense bf16/fp16 matmuls at ACHIEVABLE of the spec-sheet peak: large DiT
# matmuls and FlashAttention-2 reach 50-70% of peak on these parts; chunked layers less.
ACHIEVABLE = 0.5


@dataclass(frozen=True)
class DeviceModel:
    """One accelerator: sustained matmul FLOP/s, memory B/s, and the matmul size (rows)
    at which a skinny matmul of unknown shape reaches half its rate. memory: bytes of
    device memory (0: unknown); causal_tile: key positions per tile of its causal attention
    kernel; sms: its multiprocessors (products of known shape run in waves of tiles);
    attention_flops: its attention kernels' rate (0: the matmul rate), over padded head
    dims when score_seconds (their time per score besides the products) is set; measured:
    where the sustained rates come from when measured on the device (empty: ACHIEVABLE of
    the spec sheet). dtype: what the matmul and attention rates are for; tensor_peak and
    float32_peak: the spec sheet's dense FLOP/s of matrix products in bf16/fp16 on tensor
    cores and in float32 without them (0: unknown), which `for_dtype` scales by."""

    name: str
    matmul_flops: float
    mem_bandwidth: float
    matmul_half: float = 64.0
    memory: float = 0.0
    causal_tile: float = 0.0
    sms: int = 0
    attention_flops: float = 0.0
    score_seconds: float = 0.0
    measured: str = ""
    dtype: torch.dtype = torch.bfloat16
    tensor_peak: float = 0.0
    float32_peak: float = 0.0

    def peak(self, dtype: torch.dtype) -> float:
        """The spec sheet's dense matmul FLOP/s in `dtype` (0: unknown). float32 is what
        PyTorch runs by default: TF32 off, so no tensor cores."""
        peaks = {torch.bfloat16: self.tensor_peak, torch.float16: self.tensor_peak,
                 torch.float32: self.float32_peak}
        return peaks.get(dtype, 0.0)

    def for_dtype(self, dtype: torch.dtype) -> DeviceModel:
        """This device computing in `dtype`: its matmul and attention rates scaled by the
        ratio of its spec-sheet peaks (the share of peak it sustains in self.dtype is
        assumed in `dtype` too; the time per score, the softmax, which bf16 kernels compute
        in float32 as well, is kept). Without a peak for either dtype it warns and keeps its
        rates."""
        if dtype == self.dtype:
            return self
        have, want = self.peak(self.dtype), self.peak(dtype)
        if not have or not want:
            warnings.warn(f"{self.name} has no spec-sheet matmul rate in {_name(dtype)}: "
                          f"predicted at its {_name(self.dtype)} rates", stacklevel=2)
            return self
        scale = want / have
        return replace(self, dtype=dtype, matmul_flops=self.matmul_flops * scale,
                       attention_flops=self.attention_flops * scale)

    def rates(self) -> DeviceRates:
        # Launch cost is left out: GPU launches are asynchronous and hide behind
        # kernels of a few hundred tokens or more.
        return DeviceRates(
            matmul_flops=self.matmul_flops,
            mem_bandwidth=self.mem_bandwidth,
            attention_flops=self.attention_flops or self.matmul_flops,
            per_op_overhead=0.0,
            matmul_half=self.matmul_half,
            causal_tile=self.causal_tile,
            sms=self.sms,
            score_seconds=self.score_seconds,
        )


@dataclass(frozen=True)
class LinkModel:
    """A point-to-point link between neighbouring stages (one direction)."""

    name: str
    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


TERA, GIGA = 1e12, 1e9
# Every preset's rates are for bf16 (fp16 runs at the same tensor-core peak). float32 gets
# them scaled to the non-tensor FP32 peak (`DeviceModel.for_dtype`): PyTorch's default,
# since torch.backends.cuda.matmul.allow_tf32 is off; no preset's float32 rate is measured.
DEVICES: dict[str, DeviceModel | None] = {
    # H200 SXM: 989 TFLOP/s dense BF16/FP16 tensor, 67 TFLOP/s FP32, 4.8 TB/s HBM3e,
    # 141 GB, 132 SMs (NVIDIA H200 product brief and datasheet; the 1979 TFLOP/s quoted for
    # BF16 is with sparsity); FlashAttention's causal kernels skip masked tiles of 128 keys.
    # Measured (benchmarks/gpu_rates.py, bf16, graphed): full waves of GEMM tiles at 5.9
    # TFLOP/s an SM (778 TFLOP/s); SDPA over stale chunks at 0.37 ps a score plus its
    # products over head dims padded to 64 at 1110 TFLOP/s, fitted to 16 cases (heads of
    # 64, 72 and 128; each within 0.89-1.13x). A fit, not a hardware rate: the products
    # and the softmax overlap, and the per-score term carries what they share.
    "h200": DeviceModel("h200", 778 * TERA, 0.8 * 4800 * GIGA, memory=141 * GIGA,
                        causal_tile=128, sms=132, attention_flops=1110 * TERA,
                        score_seconds=0.37e-12,
                        measured="benchmarks/gpu_rates.py on one H200, 2026-12-04",
                        tensor_peak=989 * TERA, float32_peak=67 * TERA),
    # A100 PCIe 80GB: 312 TFLOP/s dense BF16/FP16 tensor, 19.5 TFLOP/s FP32, 1935 GB/s
    # HBM2e, 108 SMs (NVIDIA A100 datasheet).
    "a100-pcie": DeviceModel("a100-pcie", ACHIEVABLE * 312 * TERA, 0.8 * 1935 * GIGA,
                             memory=80 * GIGA, sms=108, tensor_peak=312 * TERA,
                             float32_peak=19.5 * TERA),
    # L20: 119.5 TFLOP/s dense FP16/BF16 tensor, 59.8 TFLOP/s FP32, 864 GB/s GDDR6, 48 GB,
    # 92 SMs (NVIDIA L20 datasheet).
    "l20": DeviceModel("l20", ACHIEVABLE * 119.5 * TERA, 0.8 * 864 * GIGA, memory=48 * GIGA,
                       sms=92, tensor_peak=119.5 * TERA, float32_peak=59.8 * TERA),
    # The local CPU has no spec sheet: see cpu_device(), which measures it.
    "cpu": None,
}
LINKS: dict[str, LinkModel] = {
    # NVLink 4 (H100/H200 SXM): 900 GB/s total, 450 GB/s each way; ~80% reached by NCCL.
    "nvlink4": LinkModel("nvlink4", 0.8 * 450 * GIGA, 5e-6),
    # PCIe 4.0 x16: 31.5 GB/s each way; ~25 GB/s reached with peer-to-peer copies.
    "pcie4": LinkModel("pcie4", 25 * GIGA, 10e-6),
    # PCIe 4.0 without peer-to-peer (staged through host memory): about half the rate.
    "pcie4-no-p2p": LinkModel("pcie4-no-p2p", 12 * GIGA, 25e-6),
}
