"""What every backend declares: the inputs it supports (as data), why it cannot run a given input, and its ops."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..spec import Problem, dtype_name

__all__ = ["Backend"]


class Backend:
    """One implementation of the spec (docs/SPEC.md). Subclasses set the data and `ops()`.

    Both ops take the arguments of the op schemas in csrc/registration.cpp:

        forward(q, k, v, segment_lengths, dilation_rates, split_heads, causal, scale) -> (out, lse)
        backward(grad_out, grad_lse, q, k, v, out, lse, segment_lengths, dilation_rates, split_heads, causal,
                 scale) -> (grad_q, grad_k, grad_v)

    `forward` is differentiable (autograd runs `backward`). `backward` takes the merged `out` and `lse` of the
    whole problem and returns the share of the gradient its keys give, which is what lets the ring run it on one
    block of keys of a longer sequence.
    """

    name: str = ""
    device_types: tuple[str, ...] = ()  # the device types of the tensors it takes
    dtypes: tuple[torch.dtype, ...] = ()
    max_head_dim: Optional[int] = None  # None: any
    min_capability: Optional[tuple[int, int]] = None  # the oldest CUDA compute capability, for CUDA tensors
    capability_rule: str = ""  # what min_capability stands for, said when a GPU is older

    def supported_device_types(self) -> tuple[str, ...]:
        return self.device_types

    def unavailable(self) -> Optional[str]:
        """Why this backend cannot run anything in this process (None: it can)."""
        return None

    def why_not(self, p: Problem) -> Optional[str]:
        """None if this backend can run `p`, else the reason, for messages and `explain()`."""
        devices = self.supported_device_types()
        if p.device.type not in devices:
            return f"needs {'/'.join(d.upper() for d in devices)} tensors, got {p.device.type}"
        missing = self.unavailable()
        if missing is not None:
            return missing
        if p.dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            return f"dtype {dtype_name(p.dtype)} is not supported (supported: {names})"
        if self.max_head_dim is not None and p.head_dim > self.max_head_dim:
            return f"head_dim {p.head_dim} > {self.max_head_dim}"
        if self.min_capability is not None and p.device.type == "cuda":
            have = torch.cuda.get_device_capability(p.device)
            if have < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                return f"compute capability {have[0]}.{have[1]} < {need} ({self.capability_rule})"
        return None

    def ops(self) -> tuple[Callable, Callable]:
        """(forward, backward) with the signatures above."""
        raise NotImplementedError

    def forward(self, q, k, v, p: Problem):
        """The forward op on a validated problem: returns the differentiable `(out, lse)`."""
        forward, _ = self.ops()
        return forward(q, k, v, list(p.segment_lengths), list(p.dilation_rates), p.split_heads, p.causal, p.scale)

    def __repr__(self) -> str:
        return f"<dilated_attn backend {self.name!r}>"
