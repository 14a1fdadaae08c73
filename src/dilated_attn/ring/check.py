"""The configuration check of a ring call: every rank of its groups passed the same arguments, and invalid arguments
on one rank raise on every rank within seconds instead of leaving the others waiting for it.

Each call all-gathers a small descriptor (config_fields: sizes, dtype, branches and offsets as a digest, mode, ...)
over each of its groups before any transfer; a rank whose arguments are invalid sends its error's text instead, so
that its peers raise naming it. deferred_check posts the first gather early and reads it later, so that work which
needs no peer (a rank's own documents) runs in between.
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..spec import BACKEND_CHOICES, host_offsets
from .documents import DocumentLayout
from .layout import LAYOUTS, MODES

__all__ = ["check_same_config", "config_fields", "deferred_check"]

# The call's descriptor, all-gathered before any transfer (check_same_config, deferred_check): categorical
# fields as codes.
_CODES = {
    "dtype": {d: n for n, d in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))},
    "layout": {n: i for i, n in enumerate((*LAYOUTS, "documents"))},
    "head_groups": {"all": 0, "split": 1},
    "backend": {n: i for i, n in enumerate(BACKEND_CHOICES)},
    "mode": {n: i for i, n in enumerate(MODES)},
}
_FIELDS = ("batch", "local length", "query heads", "kv heads", "head_dim", "dtype", "device type", "causal",
           "layout", "head_groups", "backend", "scale", "segment_lengths/dilation_rates/cu_seqlens", "mode",
           "return_lse")
# A rank's row of the gather, as bytes: whether it carries invalid arguments, the rank (its shard's index) whose
# arguments they are, the fields, then the length and the UTF-8 text of that error (cut to _MESSAGE_BYTES), so that
# its peers can say what was wrong.
_HEADER = struct.Struct(f"<qq{len(_FIELDS)}qq")
_MESSAGE_BYTES = 1024


def _post_config(group, q, fields: tuple[int, ...] | None, invalid: tuple[int, str] | None):
    """All-gather a small descriptor of the call over `group`, or `invalid` = (rank, message) of a rank whose
    arguments are invalid (this one's, or a peer's learnt from an earlier gather), and return `read()`, which waits
    for it and returns the first invalid arguments any row carries as (rank, message), a ValueError for
    configurations that differ, or None. Every rank takes part in this one collective whatever its arguments, so no
    rank is left waiting for a peer that raised. On a GPU the gathered rows come to the host by a copy queued
    behind the gather alone: kernels queued after this call do not delay read()."""
    if "nccl" in str(dist.get_backend(group)).lower():
        # NCCL gathers CUDA tensors only, and on a rank with bad arguments q may be a CPU tensor or no tensor.
        cuda = isinstance(q, torch.Tensor) and q.is_cuda
        dev = q.device if cuda else torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    origin, text = invalid if invalid is not None else (0, "")
    message = text.encode()[:_MESSAGE_BYTES]
    row = _HEADER.pack(int(invalid is not None), origin, *(fields or (0,) * len(_FIELDS)), len(message))
    row += message.ljust(_MESSAGE_BYTES, b"\0")
    valid = row if invalid is None else None
    mine = _to_device(row, dev) if valid is None else _descriptor(row, dev)
    if dev.type == "cuda":
        table = torch.empty((dist.get_world_size(group), mine.numel()), dtype=mine.dtype, device=dev)
        dist.all_gather_into_tensor(table, mine, group=group)
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dev))

        def read():
            copied.synchronize()
            return _read_config(host, valid)
        return read
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return functools.partial(_read_config, torch.stack(every), valid)


def _to_device(row: bytes, dev: torch.device) -> torch.Tensor:
    """A descriptor row as a uint8 tensor on `dev`: on a GPU copied from pinned memory, so that the copy waits for no
    kernel queued before it on this stream."""
    mine = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    return mine.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else mine


@functools.lru_cache(maxsize=64)
def _descriptor(row: bytes, dev: torch.device) -> torch.Tensor:
    """_to_device of a valid call's row, kept (it is the same on each call of one configuration, and read only)."""
    return _to_device(row, dev)


def _read_config(table: torch.Tensor, valid: Optional[bytes] = None):
    """_post_config's result from the gathered rows (on the host). `valid`: this rank's row where its arguments are
    valid; where every rank sent that row, the call goes ahead without the rows being decoded."""
    if valid is not None and table.numpy().tobytes() == valid * table.shape[0]:
        return None
    headers = [_HEADER.unpack(bytes(h)) for h in table[:, :_HEADER.size].tolist()]
    carried = sorted({(h[1], j) for j, h in enumerate(headers) if h[0]})
    if carried:
        first, j = carried[0]
        text = bytes(table[j, _HEADER.size:_HEADER.size + headers[j][-1]].tolist()).decode(errors="ignore")
        more = sorted({o for o, _ in carried[1:]} - {first})
        also = f" (and those of rank{'s' * (len(more) > 1)} {', '.join(map(str, more))})" if more else ""
        return first, text + also
    for col, name in enumerate(_FIELDS, start=2):
        values = [h[col] for h in headers]
        if any(x != values[0] for x in values):
            bad = next(j for j, x in enumerate(values) if x != values[0])
            shown = "" if name in ("scale", "segment_lengths/dilation_rates/cu_seqlens") else f" ({values})"
            return ValueError(f"ring_attention: every rank of the group must pass the same {name}, but rank {bad} "
                              f"of the group passes another than its rank 0{shown}")
    return None


def check_same_config(groups, q, fields, error: Exception | None, first: Optional[Callable] = None) -> None:
    """_post_config over each group of the call in turn (the 2-D mode's inner and outer groups), carrying any
    invalid arguments into the next gather so that every rank of every group learns them, then raise on every rank:
    the rank with invalid arguments its own error as `ring_attention: rank j: ...` (its own type), every other a
    ValueError `ring_attention: rank j's arguments are invalid: ...` (j: the index of that rank's shard).
    `first`: the first group's gather where it is posted already (deferred_check)."""
    invalid = None if error is None else (groups.rank, str(error))
    mismatch = None
    for i, group in enumerate(groups.all):
        seen = (first if i == 0 and first is not None else _post_config(group, q, fields, invalid))()
        if isinstance(seen, tuple):
            invalid = seen if invalid is None else min(invalid, seen)
        elif seen is not None and mismatch is None:
            # differing configurations in this group: carried on like invalid arguments, so that the ranks of the
            # other groups raise too instead of waiting for this group's ranks
            mismatch = seen
            invalid = invalid or (groups.rank, str(seen).removeprefix("ring_attention: "))
    if error is not None:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"ring_attention: rank {groups.rank}: {error}") from error
    if mismatch is not None:
        raise mismatch
    if invalid is not None:
        raise ValueError(f"ring_attention: rank {invalid[0]}'s arguments are invalid: {invalid[1]}")


def deferred_check(groups, q, fields) -> Callable[[], None]:
    """check_same_config of valid arguments as a call: the first group's gather is posted now (on the current
    stream) and read by the call, so that work which needs no peer can be queued in between."""
    return functools.partial(check_same_config, groups, q, fields, None, _post_config(groups.all[0], q, fields, None))


def config_fields(call, q, segment_lengths, options: dict, cu_seqlens) -> tuple[int, ...]:
    """The fields of a valid call's descriptor (_FIELDS); `options`: ring_attention's keyword arguments."""
    # every rank's branches, and offsets where the sequences are packed (or the placement of a DocumentLayout, whose
    # ranks hold unequal rows), must agree
    layout = options["layout"]
    documents = isinstance(layout, DocumentLayout)
    agreed = (("dense",) if segment_lengths is None else call.branches,
              host_offsets(cu_seqlens) if cu_seqlens is not None else None, layout.digest if documents else None)
    digest = zlib.crc32(repr(agreed).encode())
    scale_bits = struct.unpack("<q", struct.pack("<d", call.problem.scale))[0]
    p = call.problem
    return (
        p.batch, layout.total if documents else p.seq_len, p.num_heads, p.num_kv_heads, p.head_dim,
        _CODES["dtype"].get(p.dtype, -1),
        ["cpu", "cuda"].index(q.device.type) if q.device.type in ("cpu", "cuda") else 2, int(options["causal"]),
        _CODES["layout"]["documents" if documents else layout], _CODES["head_groups"][options["head_groups"]],
        _CODES["backend"][options["backend"]], scale_bits, digest, _CODES["mode"][call.mode],
        int(options["return_lse"]))
