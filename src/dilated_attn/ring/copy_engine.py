"""The head-parallel modes' exchanges moved by the GPUs' copy engines (heads.py).

NCCL's all-to-all is a kernel: queued beside an attention kernel that holds every SM it runs at that kernel's tail,
and where it does get SMs it slows the attention. Here each rank has a workspace of symmetric memory that every rank
of the group maps (torch.distributed._symmetric_memory), and the rows move by device-to-device copies, which the copy
engines run without SMs, from streams of their own (one per peer, so that the peers' copies run side by side):

    to_heads      each rank packs what it sends into a region of its workspace; after a barrier each rank pulls
                  its part of that region from every rank
    to_positions  each rank pushes each rank's part into that rank's region; the phase's one barrier at its end
                  (settle) says that every push has landed

A phase is one forward or one backward of a head-parallel call. It opens with its to_heads exchanges, all posted
before its first attention kernel, so that their barriers wait for no kernel; it reads its to_positions exchanges
after settle(), whose barrier also says that no rank still reads a region, so the next phase may reuse them. The
ranks reserve the same regions in the same order (the configuration check makes their calls alike), so a region's
offset is the same on every rank. A region that does not fit the workspace goes through NCCL's all-to-all instead,
and the next phase first grows the workspace to the largest phase seen: from the second call on, every exchange fits.

Used for NCCL groups on CUDA tensors where every rank of the group can map symmetric memory (decided once per group,
by all its ranks alike); DILATED_ATTN_COPY_ENGINE=0 turns it off.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["CopyEngines", "copy_engines", "nbytes"]

ENABLED = os.environ.get("DILATED_ATTN_COPY_ENGINE", "1") != "0"
_ALIGN = 512  # bytes: every region starts on a boundary the copies move whole lines from
_BARRIER_TIMEOUT_MS = 300_000  # a peer that never arrives stops the process with an error instead of a hang

_engines: dict = {}  # (group name, device) -> CopyEngines, or None where the group cannot use them


def copy_engines(group, device: torch.device) -> Optional["CopyEngines"]:
    """The copy engines of `group` on `device`, or None where its exchanges go through NCCL's all-to-all."""
    if not ENABLED or device.type != "cuda" or "nccl" not in str(dist.get_backend(group)).lower():
        return None
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, device)
    if key not in _engines:
        try:
            import torch.distributed._symmetric_memory  # noqa: F401 (a torch without it: NCCL)
            _engines[key] = CopyEngines(group, device)
        except (ImportError, AttributeError):
            _engines[key] = None
    return _engines[key]


class CopyEngines:
    """One group's workspace and streams on this rank (the module's docstring says how they are used)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # the barriers, at high priority so that a barrier queued beside an attention kernel gets the first free SM
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.copies = [torch.cuda.Stream(device) for _ in range(self.P)]  # the copies from or to rank j
        self.usable: Optional[bool] = None  # decided by every rank together, at the first growth
        self.workspaces = []  # every workspace made (a peer may have mapped any of them): the last one serves
        self.peers: list[torch.Tensor] = []  # the last workspace of each rank, as bytes
        self.capacity = 0
        self.demand = 0  # the most bytes a phase has reserved
        self.cursor = 0
        self.moved = self.settled = False

    # ---- phases

    def begin(self, check: Optional[Callable[[], None]] = None) -> Optional[Callable[[], None]]:
        """Open a phase. Where an earlier phase reserved more than the workspace holds, grow it first: a collective,
        so ring_attention's configuration check (`check`) is read before it; returns `check` where it was not."""
        current = torch.cuda.current_stream(self.device)
        for stream in (self.stream, *self.copies):  # nothing of the last phase still moves when this one packs
            current.wait_stream(stream)
        if self.demand > self.capacity and self.usable is not False:
            if check is not None:
                check()
                check = None
            self._grow(-(-(self.demand + self.demand // 8) // _ALIGN) * _ALIGN)  # room for a phase a bit larger
        self.cursor, self.moved, self.settled = 0, False, False
        return check

    def end(self) -> None:
        """Close a phase: settle() where anything moved, so that no rank reads a region the next phase refills."""
        if self.moved and not self.settled:
            self.settle()

    def settle(self) -> None:
        """Wait (on the caller's stream) until every rank's copies of this phase are done: its pushes landed, its
        pulls read. The phase's to_positions exchanges are read after it."""
        current = torch.cuda.current_stream(self.device)
        if not self.settled:
            for stream in self.copies:
                self.stream.wait_stream(stream)
            with torch.cuda.stream(self.stream):
                self._handle.barrier(channel=0, timeout_ms=_BARRIER_TIMEOUT_MS)
            self.settled = True
        current.wait_stream(self.stream)

    def reserve(self, size: int) -> Optional[int]:
        """The offset of a region of `size` bytes for this phase, or None where the workspace cannot hold it (the
        exchange then goes through NCCL; the next phase grows the workspace)."""
        start = -(-self.cursor // _ALIGN) * _ALIGN
        self.cursor = start + size
        self.demand = max(self.demand, self.cursor)
        return start if self.cursor <= self.capacity else None

    def _grow(self, size: int) -> None:
        import torch.distributed._symmetric_memory as symm

        first = self.usable is None
        if not first:  # a larger workspace on a group that has one: a failure is this process's (out of memory)
            buf = symm.empty(size, dtype=torch.uint8, device=self.device)
            handle = symm.rendezvous(buf, self.group)
        else:  # every rank must be able to allocate, then to map the others', or none uses them
            buf = handle = None
            with contextlib.suppress(Exception):
                buf = symm.empty(size, dtype=torch.uint8, device=self.device)
                enable = getattr(symm, "enable_symm_mem_for_group", None)
                if enable is not None:  # needed before rendezvous by older torch; a no-op where done
                    enable(self.group.group_name)
            if self._all(buf is not None):
                with contextlib.suppress(Exception):
                    handle = symm.rendezvous(buf, self.group)
            self.usable = self._all(handle is not None)
            if not self.usable:
                return
        self.workspaces.append(buf)
        self._handle, self.capacity = handle, size
        self.peers = [handle.get_buffer(j, (size,), torch.uint8) for j in range(self.P)]

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the group."""
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # ---- the two exchanges

    def region(self, start: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """This rank's region at `start` as a tensor of `shape` (to pack into, or to read what landed)."""
        n = nbytes(shape, dtype)
        return self.peers[self.rank][start:start + n].view(dtype).view(shape)

    def pull(self, start: int, shape, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.cuda.Event]]:
        """to_heads: every rank has packed `[P, ...]` (`shape`) into its region at `start`, entry j for rank j.
        Returns (recv `[P, ...]`, entry j from rank j, the events after which it holds them)."""
        recv = torch.empty(shape, dtype=dtype, device=self.device)
        part = nbytes(shape, dtype) // self.P
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the region is packed
        with torch.cuda.stream(self.stream):
            self._handle.barrier(channel=0, timeout_ms=_BARRIER_TIMEOUT_MS)  # and so are the peers'
        events = []
        for j, stream in enumerate(self.copies):
            stream.wait_stream(self.stream)
            with torch.cuda.stream(stream):
                first = start + self.rank * part
                recv[j].view(-1).view(torch.uint8).copy_(self.peers[j][first:first + part])
                events.append(torch.cuda.Event())
                events[-1].record(stream)
            recv.record_stream(stream)
        self.moved = True
        return recv, events

    def push(self, start: int, send: torch.Tensor) -> None:
        """to_positions: entry j of `send` `[P, ...]` goes into entry `rank` of rank j's region at `start`;
        read the region after settle()."""
        part = send.numel() * send.element_size() // self.P
        packed = torch.cuda.Event()
        packed.record(torch.cuda.current_stream(self.device))
        for j, stream in enumerate(self.copies):
            stream.wait_event(packed)
            with torch.cuda.stream(stream):
                first = start + self.rank * part
                self.peers[j][first:first + part].copy_(send[j].view(-1).view(torch.uint8))
            send.record_stream(stream)
        self.moved = True


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`."""
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n
