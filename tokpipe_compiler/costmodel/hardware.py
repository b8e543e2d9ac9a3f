"""Spec-sheet presets of accelerators and links, for planning and simulation."""

from __future__ import annotations

from dataclasses import dataclass

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
    the spec sheet)."""

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


TERA, GIGA = 1e12, 1e9
DEVICES: dict[str, DeviceModel | None] = {
    # H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB, 132 SMs (NVIDIA H200
    # product brief); FlashAttention's causal kernels skip masked tiles of 128 keys.
    # Measured (benchmarks/gpu_rates.py, bf16, graphed): full waves of GEMM tiles at 5.9
    # TFLOP/s an SM (778 TFLOP/s); SDPA over stale chunks at 0.37 ps a score plus its
    # products over head dims padded to 64 at 1110 TFLOP/s, fitted to 16 cases (heads of
    # 64, 72 and 128; each within 0.89-1.13x). A fit, not a hardware rate: the products
    # and the softmax overlap, and the per-score term carries what they share.
    "h200": DeviceModel("h200", 778 * TERA, 0.8 * 4800 * GIGA, memory=141 * GIGA,
                        causal_tile=128, sms=132, attention_flops=1110 * TERA,
                        score_seconds=0.37e-12,
                        measured="benchmarks/gpu_rates.py on one H200, 2026-12-04"),
    # A100 PCIe 80GB: 312 TFLOP/s dense BF16, 1935 GB/s HBM2e, 108 SMs (NVIDIA A100
    # datasheet).
    "a100-pcie": DeviceModel("a100-pcie", ACHIEVABLE * 312 * TERA, 0.8 * 1935 * GIGA,
                             memory=80 * GIGA, sms=108),
    # L20: 119.5 TFLOP/s dense FP16/BF16 tensor, 864 GB/s GDDR6, 48 GB, 92 SMs (NVIDIA L20
    # datasheet).
    "l20": DeviceModel("l20", ACHIEVABLE * 119.5 * TERA, 0.8 * 864 * GIGA, memory=48 * GIGA,
                       sms=92),
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
