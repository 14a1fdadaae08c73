"""dilated_attn.memo.read_once: a value read from a tensor is read again only when it may have changed (its users:
spec.host_offsets in tests/test_varlen.py, the transformers mask in tests/test_transformers.py)."""

import gc

import torch

from dilated_attn import memo


def _counting(value_of):
    calls = []

    def read(x):
        calls.append(x)
        return value_of(x)
    return read, calls


def test_a_value_is_read_once_while_its_tensor_is_unchanged():
    read, calls = _counting(lambda x: x.sum().item())
    x = torch.tensor([1.0, 2.0])
    assert [memo.read_once(x, "sum", read) for _ in range(3)] == [3.0, 3.0, 3.0]
    assert len(calls) == 1
    assert memo.read_once(x, "sum of something else", read) == 3.0  # another `what`: its own read
    assert len(calls) == 2


def test_a_write_in_place_or_another_tensor_reads_again():
    read, calls = _counting(lambda x: x.sum().item())
    x = torch.tensor([1.0, 2.0])
    memo.read_once(x, "sum", read)
    x.add_(1)  # the version counter moves
    assert memo.read_once(x, "sum", read) == 5.0
    y = x.clone()  # equal values, another tensor
    assert memo.read_once(y, "sum", read) == 5.0
    assert len(calls) == 3


def test_a_tensor_that_dies_leaves_nothing_behind():
    x = torch.tensor([1.0])
    memo.read_once(x, "first", lambda t: t.item())
    key = (id(x), "first")
    assert key in memo._KEPT
    del x
    gc.collect()
    assert key not in memo._KEPT


def test_inference_tensors_are_read_every_time():
    read, calls = _counting(lambda x: x.sum().item())
    with torch.inference_mode():
        x = torch.tensor([1.0, 2.0])
    for _ in range(3):
        assert memo.read_once(x, "sum", read) == 3.0
    assert len(calls) == 3
