"""Random dilated-attention configurations and inputs shared by the parity tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    segment_lengths: tuple
    dilation_rates: tuple
    head_groups: str
    causal: bool
    layout: str  # how q/k/v are laid out in memory: "contiguous", "transposed" (heads-first storage), "strided"

    def kwargs(self):
        return dict(causal=self.causal, head_groups=self.head_groups)


def random_case(rng: random.Random, max_seq: int = 96) -> Case:
    num_kv_heads = rng.choice([1, 1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 1, 2, 3])
    seq_len = rng.randint(1, max_seq)
    m = rng.randint(1, 4)
    head_groups = rng.choice(["all", "split"]) if num_heads >= m else "all"
    segs, dils = [], []
    for _ in range(m):
        kind = rng.random()
        if kind < 0.15:
            w = seq_len + rng.randint(0, 40)  # w >= N: one (clipped) segment
        else:
            w = rng.randint(1, max(1, seq_len))
        r = rng.randint(1, 8)
        if rng.random() < 0.1:
            r = w + rng.randint(1, 4)  # r > w: one member per segment at most
        segs.append(w)
        dils.append(r)
    return Case(
        batch=rng.randint(1, 2),
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([1, 3, 8, 16, 17, 32, 40]),
        segment_lengths=tuple(segs),
        dilation_rates=tuple(dils),
        head_groups=head_groups,
        causal=rng.random() < 0.5,
        layout=rng.choice(["contiguous", "transposed", "strided"]),
    )


def make_tensor(shape, dtype, layout: str, generator=None, device="cpu"):
    """Random normal data in the memory layout `layout`, as a leaf that requires grad."""
    B, N, H, D = shape

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)

    if layout == "transposed":  # stored [B, H, N, D]: non-contiguous, last dim still dense
        x = randn(B, H, N, D).transpose(1, 2)
    elif layout == "strided":  # every other element of the last dim: stride(-1) == 2
        x = randn(B, N, H, 2 * D)[..., ::2]
    else:
        x = randn(B, N, H, D)
    return x.detach().requires_grad_()


def make_qkv(case: Case, dtype=torch.float64, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    B, N, D = case.batch, case.seq_len, case.head_dim
    q = make_tensor((B, N, case.num_heads, D), dtype, case.layout, g, device)
    k = make_tensor((B, N, case.num_kv_heads, D), dtype, case.layout, g, device)
    v = make_tensor((B, N, case.num_kv_heads, D), dtype, case.layout, g, device)
    return q, k, v


def uncovered_positions(case: Case) -> bool:
    """True if some (position, head) is a member of no branch (its output must be 0, its LSE -inf)."""
    from dilated_attn.branches import branch_table

    table = branch_table(case.segment_lengths, case.dilation_rates, case.seq_len, case.num_heads, case.head_groups)
    for h in range(case.num_heads):
        for p in range(case.seq_len):
            if not any(
                b.head_lo <= h < b.head_hi and (p % b.seg_len) % b.dilation == b.offset(h) for b in table
            ):
                return True
    return False
