"""Small models written the way users write them, for the tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A DiT block: adaLN-modulated self-attention and MLP."""

    def __init__(self, width: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.ada = nn.Linear(width, 4 * width)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift1, scale1, shift2, scale2 = self.ada(F.silu(cond)).chunk(4, dim=-1)
        h = self.norm1(x) * (1 + scale1[:, None]) + shift1[:, None]
        b, n, w = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, w))
        h = self.norm2(x) * (1 + scale2[:, None]) + shift2[:, None]
        return x + self.mlp(h)


class TinyDiT(nn.Module):
    """Patchify conv + positional table + timestep/class conditioning + blocks + unpatchify."""

    def __init__(self, depth: int = 2, width: int = 32, heads: int = 2, grid: int = 8,
                 patch: int = 2, channels: int = 4, classes: int = 10):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.embed = nn.Conv2d(channels, width, patch, stride=patch)
        tokens = (grid // patch) ** 2
        self.register_buffer("pos", torch.randn(1, tokens, width) * 0.1)
        self.t_mlp = nn.Sequential(nn.Linear(16, width), nn.SiLU(), nn.Linear(width, width))
        self.label = nn.Embedding(classes, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.out = nn.Linear(width, patch * patch * channels)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, labels: torch.Tensor):
        b, c, h, w = latents.shape
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(timestep_features(timestep, 16)) + self.label(labels)
        for block in self.blocks:
            x = block(x, cond)
        p = self.patch
        x = self.out(x).reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)


class TinyCausalLM(nn.Module):
    """A causal transformer over a sequence of embeddings [B, L, D]."""

    def __init__(self, depth: int = 2, width: int = 32, heads: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads, causal=True) for _ in range(depth))
        self.cond = nn.Parameter(torch.randn(1, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.cond)
        return x


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(1000.0) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class MeanOverTokens(nn.Module):
    """Mixes tokens with a mean: cannot be chunked."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.mean(dim=1, keepdim=True)


class ConvAcrossRows(nn.Module):
    """A 3x3 convolution on the latent: each output row reads its neighbours' rows."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.conv(latents)


class SortOverTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(x * 2, dim=1).values


def dit_inputs(model: TinyDiT, grid: int, seed: int = 0, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, model.channels, grid, grid, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return latents, t, labels
