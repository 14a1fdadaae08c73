"""Helpers for code that torch.compile traces: values fixed when a function is traced, and one-time warnings.

The dispatch reads the environment, the device's properties and torch's matmul settings on every eager call. Under
torch.compile those reads must not break the graph, so the functions that make them are marked constant: dynamo
calls them once, when it traces, and bakes the result into the graph (no guard). A compiled function therefore
keeps what it saw when it was traced until it recompiles (`torch.compiler.reset()`).
"""

from __future__ import annotations

import warnings

__all__ = ["trace_constant", "warn_once"]


def trace_constant(fn):
    """`torch.compiler.assume_constant_result(fn)`, without importing torch._dynamo when the package is imported
    (it costs about 2 s, and eager users never need it): the marker that function sets is this attribute, which
    dynamo reads when it meets a call. tests/test_dispatch.py's fullgraph tests fail if it stops working."""
    fn._dynamo_marked_constant = True
    return fn


_WARNED: set[str] = set()


@trace_constant
def warn_once(message: str, stacklevel: int = 1) -> bool:
    """warnings.warn(message) the first time this message comes, then never again in this process.

    Dynamo cannot trace warnings.warn (a graph break); marked constant, it runs at trace time instead, so a
    compiled caller warns once when it is traced. `stacklevel` counts from the caller of warn_once.
    """
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)
    return True
