"""dilated_attn.compile_hints: one-time warnings, and the marker that tells dynamo a function's result is constant
(tests/test_dispatch.py's fullgraph tests show the marker working under torch.compile)."""

import warnings

import torch

from dilated_attn import compile_hints


def test_warn_once_warns_the_first_time_a_message_comes():
    message = "a message test_warn_once made up"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert compile_hints.warn_once(message)
        compile_hints.warn_once(message + " (another)")
    assert [str(w.message) for w in caught] == [message, message + " (another)"]


def test_warn_once_points_at_its_callers_caller():
    def library_function():
        compile_hints.warn_once("warned from inside a library function", stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library_function()  # this line is the one the warning names
    assert caught[0].filename == __file__


def test_trace_constant_sets_dynamos_marker_and_returns_the_function():
    def probe():
        return 3

    assert compile_hints.trace_constant(probe) is probe and probe._dynamo_marked_constant
    # the attribute is the one torch.compiler.assume_constant_result sets
    marked = torch.compiler.assume_constant_result(lambda: 3)
    assert getattr(marked, "_dynamo_marked_constant", False)
