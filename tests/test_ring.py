"""ring_attention across processes: gloo on CPU (float64, CI) and NCCL on GPUs (bf16, -m multigpu).

Every case runs in spawned worker processes that form a process group. Each rank builds the same global
q, k, v, output gradients and LSE gradients from a seed, runs `ring_attention` on its shard, and compares
the output, the LSE and the gradients of its shards with `dilated_attention` on the global tensors (the
float64 reference), restricted to its positions. The workers write their findings to files the test reads.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import multiprocessing
import os
import random
import socket
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dilated_attn
from dilated_attn.ring import ring_plan
from dilated_attn.ring.layout import chunks
from dilated_attn.ring.plan import BranchRun, segment_ranges

# float64 on both sides: only summation order differs (merges, blocks), a few ulps of values of order 1.
TOL_F64 = 1e-10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_inputs(case: dict, dtype, device):
    B, N, Hq, Hkv, D = case["shape"]
    g = torch.Generator().manual_seed(case.get("seed", 0))

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    return rand(B, N, Hq, D), rand(B, N, Hkv, D), rand(B, N, Hkv, D), rand(B, N, Hq, D), rand(B, Hq, N)


def _pack_offsets(case, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(case["lengths"])], dtype=torch.int32, device=device)


def _options(case, backend) -> dict:
    return dict(causal=case.get("causal", False), head_groups=case.get("head_groups", "all"), return_lse=True,
                backend=backend, scale=case.get("scale"))


def _ring_options(case, q, backend="auto") -> dict:
    """ring_attention's keyword arguments for a case on this rank's shard q (a pack's: [L, H, D]; under a
    DocumentLayout, which holds the offsets, its rows)."""
    layout = case.get("layout", "contiguous")
    kw = dict(_options(case, case.get("backend", backend)), layout=layout, group=_GROUP, mode=case.get("mode", "auto"))
    if "lengths" in case and not isinstance(layout, dilated_attn.DocumentLayout):
        kw["cu_seqlens"] = _pack_offsets(case, q.device)
    return kw


def _placed(case) -> dict:
    """A case with layout="documents" as one with the DocumentLayout place_documents makes for it on this world."""
    if case.get("layout") != "documents":
        return case
    return dict(case, layout=dilated_attn.place_documents(_pack_offsets(case, "cpu"), case.get("w"), case.get("r"),
                                                          causal=case.get("causal", False), group=_GROUP))


def _attention(case, q, k, v, ring: bool, backend="auto"):
    """A case's (out, lse). A pack of sequences of case["lengths"] (B = 1) runs on the [N, H, D] tensors of its
    batch of one, and its results come back as a batch of one."""
    w, r = case.get("w"), case.get("r")
    packed = "lengths" in case
    if packed:
        q, k, v = q[0], k[0], v[0]
    if ring:
        out, lse = dilated_attn.ring_attention(q, k, v, w, r, **_ring_options(case, q, backend))
    elif packed:  # dense: one segment of each sequence
        out, lse = dilated_attn.dilated_attention_varlen(q, k, v, _pack_offsets(case, q.device), w or [q.shape[0]],
                                                         r or [1], **_options(case, backend))
    else:
        N = q.shape[1]
        out, lse = dilated_attn.dilated_attention(q, k, v, w or [N], r or [1], **_options(case, backend))
    return (out[None], lse[None]) if packed else (out, lse)


def _run(case, q, k, v, grad_out, grad_lse, ring: bool, backend="auto", lse_gradient: bool = True):
    """(out, lse, dq, dk, dv) of one call; ring=True treats the inputs as this rank's shards. `lse_gradient=False`:
    this rank's loss does not use the LSE (where the case's does)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = _attention(case, *leaves, ring=ring, backend=backend)
    finite = torch.isfinite(lse)
    if case.get("lse_gradient", True) and lse_gradient:
        torch.autograd.backward((out, lse), (grad_out, torch.where(finite, grad_lse, 0)))
    else:  # the usual training step: only the output has a gradient
        out.backward(grad_out)
    return [out.detach(), lse.detach()] + [x.grad for x in leaves]


def _local(x, case, dim=1):
    # a 2-D mode's shards are those of the world group (_mesh_pair), which shard() also cuts from the pair
    return dilated_attn.shard(x, layout=case.get("layout", "contiguous"), dim=dim, group=_GROUP)


_GROUP = None  # the process group of the current case (None: the world)


_MESHES: dict = {}


def _mesh_pair(inner_size: int):
    """(ring_group, heads_group) of this rank when the world is cut into consecutive inner groups of inner_size
    ranks (the heads) and outer groups of the ranks with the same inner index (the ring): the sequence index of a
    rank is then its global rank, so shard() with the world group cuts its shard. Created once per world (every
    rank creates every group, in one order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if inner_size not in _MESHES:
        inner = [dist.new_group(list(range(o, o + inner_size))) for o in range(0, world, inner_size)]
        outer = [dist.new_group(list(range(i, world, inner_size))) for i in range(inner_size)]
        _MESHES[inner_size] = (inner, outer)
    inner, outer = _MESHES[inner_size]
    return outer[rank % inner_size], inner[rank // inner_size]


def _compare_f64(case, rank):
    global _GROUP
    if case.get("subgroups"):  # the world cut into halves, each running its own ring
        world = dist.get_world_size()
        halves = [dist.new_group(list(range(0, world // 2))), dist.new_group(list(range(world // 2, world)))]
        _GROUP = halves[rank * 2 // world]
    if case.get("mode") == "2d":
        _GROUP = _mesh_pair(case["inner"])
    import dilated_attn.ring.blocks as blocks
    import dilated_attn.ring.comm as comm

    eager, memory = comm.RingComm.eager, blocks.Sums.memory
    if case.get("stepwise"):  # the ring's step-by-step exchange, which large transfers take
        comm.RingComm.eager = lambda self, heads, kv_heads: False
    if case.get("poisoned"):  # the gradient sums' memory NaN: a row read before any block reached it shows
        blocks.Sums.memory = staticmethod(lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype,
                                                                                   device=device))
    try:
        return _compare_in_group(_placed(case))
    finally:
        _GROUP = None
        comm.RingComm.eager, blocks.Sums.memory = eager, memory


def _compare_in_group(case):
    q, k, v, go, gl = _global_inputs(case, torch.float64, "cpu")
    using = case.get("lse_gradient_ranks")  # the ranks whose loss uses the LSE (default: every rank's)
    if using is not None:  # the others' positions take no LSE gradient in the reference either
        P, N = dist.get_world_size(), q.shape[1]
        for j in set(range(P)) - set(using):
            for a, b in chunks(j, P, N // P, case.get("layout", "contiguous")):
                gl[..., a:b] = 0
    want = _run(case, q, k, v, go, gl, ring=False, backend="cpu")
    got = _run(case, *(_local(x, case) for x in (q, k, v, go)), _local(gl, case, dim=2), ring=True,
               lse_gradient=using is None or dist.get_rank() in using)
    errors = _errors(got, [_local(b, case, dim) for b, dim in zip(want, (1, 2, 1, 1, 1))])
    if "lengths" in case:  # a pack: the mode that ran (auto: heads where it runs, else case["ran"])
        local = [_local(x, case)[0] for x in (q, k, v)]
        ran = dilated_attn.explain_ring(*local, case.get("w"), case.get("r"), **_ring_options(case, local[0])).mode
        if ran != case.get("ran", case.get("mode", "heads")):
            errors["mode"] = ran
    return errors


def _errors(got, want) -> dict:
    """What differs between a rank's (out, lse, dq, dk, dv) and the reference's at its positions, by name."""
    errors = {}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            errors[name] = f"shape/dtype {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
            continue
        if name == "lse" and not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            errors[name] = "positions without keys differ"
            continue
        both = torch.isfinite(b)
        err = (a[both] - b[both]).abs().max().item() if both.any() else 0.0
        if not err <= TOL_F64:
            errors[name] = err
    return errors


# A process group's timeout bounds how long a rank waits for a dead or diverging peer (default: 30 min).
PG_TIMEOUT_S = 60
# The longest a spawned world may run before the test kills it and fails (a hang is a failure, not a wait).
WORLD_DEADLINE_S = 300


def _worker(rank, world, port, backend, job, cases, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    results = []
    for case in cases:
        try:
            results.append(JOBS[job](case, rank))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            results.append({"exception": type(exc).__name__, "message": str(exc),
                            "traceback": traceback.format_exc()})
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if job not in ("die", "release"):  # the group lost a member, or the job tore it down
        # every rank done with its collectives before any tears its connections down (a gloo rank whose peer
        # left first can abort at exit)
        dist.barrier()
        dist.destroy_process_group()
        # The results are on disk. Leave without the interpreter's teardown: at exit, gloo's threads still
        # occasionally abort the process ("terminate called without an active exception") after a clean
        # destroy_process_group, a failure of torch's teardown rather than of anything this test checks.
        os._exit(0)


# gloo's ranks are forked from a server process that has imported torch, the package and this module once (not
# spawned afresh, each importing them again: 2-5 s a world, most of this file's time). NCCL's are spawned: a rank
# forked after anything in the server touched CUDA could not use it.
multiprocessing.set_forkserver_preload(["torch", "dilated_attn", __name__])


def _spawn(world, backend, job, cases, tmp_path):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), backend, job, cases, str(tmp_path)), nprocs=world,
                             join=False, start_method="forkserver" if backend == "gloo" else "spawn")
    deadline = time.monotonic() + WORLD_DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{job}: the {world} ranks did not finish within {WORLD_DEADLINE_S} s (a hang)")
    return [json.load(open(tmp_path / f"rank{r}.json")) if (tmp_path / f"rank{r}.json").exists() else None
            for r in range(world)]


# ---------------------------------------------------------------------------------------------------------
# Cases


def _named_cases(P):
    """Dense, dilated-local, dilated-spanning and unaligned branches, causal with both layouts, GQA/MQA,
    both head groupings, odd local lengths (contiguous); batch 2 throughout (a batch of 1 hid a zigzag defect)."""
    L = 8
    N = P * L
    cases = [
        dict(name="dense", shape=(2, N, 4, 2, 5)),
        dict(name="dense causal", shape=(2, N, 4, 4, 5), causal=True),
        dict(name="dense causal zigzag", shape=(2, N, 4, 1, 5), causal=True, layout="zigzag"),
        dict(name="dense zigzag", shape=(2, N, 3, 3, 4), layout="zigzag"),
        # segments shorter than a zigzag chunk, not causal: a rank reads two ranges of a peer's rows
        dict(name="zigzag short segments", shape=(2, P * 6, 1, 1, 2), w=[2], r=[1], layout="zigzag"),
        dict(name="zigzag short segments, GQA", shape=(2, P * 6, 4, 2, 3), w=[2, 4, 3 * P], r=[1, 2, 3],
             layout="zigzag"),
        dict(name="dilated local", shape=(2, N, 4, 2, 4), w=[4, 8], r=[1, 2]),
        dict(name="dilated local causal zigzag", shape=(2, N, 4, 2, 4), w=[2, 4], r=[1, 2], causal=True,
             layout="zigzag"),
        dict(name="dilated spanning", shape=(2, N, 4, 2, 4), w=[N], r=[2]),
        dict(name="mixed causal", shape=(2, N, 4, 2, 4), w=[4, 2 * L, N], r=[1, 2, 4], causal=True),
        dict(name="mixed causal zigzag", shape=(2, N, 8, 2, 4), w=[4, 2 * L, N], r=[1, 2, 4], causal=True,
             layout="zigzag"),
        dict(name="split heads", shape=(2, N, 6, 3, 4), w=[4, N, 3 * N], r=[1, 3, 5], head_groups="split"),
        dict(name="split heads causal zigzag", shape=(2, N, 5, 5, 4), w=[4, 2 * L], r=[2, 4],
             head_groups="split", causal=True, layout="zigzag"),
        dict(name="unaligned segments", shape=(2, N, 4, 2, 3), w=[5, 7, 3 * L + 1], r=[2, 3, 5], causal=True),
        dict(name="r > w and MQA", shape=(2, N, 6, 1, 3), w=[3, 2 * L], r=[4, 3 * L]),
        dict(name="GQA heads across offset groups", shape=(2, N, 6, 3, 4), w=[N], r=[2], causal=True),
        dict(name="odd local length", shape=(2, P * 7, 4, 2, 3), w=[3, 10], r=[1, 2], causal=True),
        dict(name="LongNet offsets, 12 heads", shape=(2, N, 12, 6, 3), w=[4, 2 * L, N], r=[1, 2, 8], causal=True,
             layout="zigzag"),
        # every rank's keys at once, each head stack's blocks joined into one (test_joined_blocks)
        dict(name="LongNet, joined blocks", shape=(2, N, 4, 4, 3), w=[4, L, N], r=[1, 2, 4]),
        # batch 1: the received rows land in the joined buffers in place (the ring's path only)
        dict(name="LongNet, joined blocks, batch 1", shape=(1, N, 4, 4, 3), w=[4, L, N], r=[1, 2, 4], ring_only=True),
        dict(name="custom scale", shape=(2, N, 2, 2, 3), w=[N], r=[1], scale=0.37, causal=True),
        dict(name="reference blocks", shape=(2, N, 4, 2, 3), w=[4, N], r=[1, 2], causal=True, layout="zigzag",
             backend="reference"),
        # no LSE gradient: the blocks' backward is given none (as the cudnn backend's needs)
        dict(name="mixed causal zigzag, no LSE gradient", shape=(2, N, 8, 2, 4), w=[4, 2 * L, N], r=[1, 2, 4],
             causal=True, layout="zigzag", lse_gradient=False),
        dict(name="dense, no LSE gradient", shape=(2, N, 4, 2, 5), lse_gradient=False),
        # beyond int64: the same branches as (N, N) and (4, 2), which the plan and the ops get
        dict(name="huge w and r", shape=(2, N, 4, 2, 4), w=[2**64 + 1, 4], r=[2**70 + 5, 2], causal=True,
             layout="zigzag"),
    ]
    for c in cases:
        c["seed"] = zlib.crc32(c["name"].encode())
    return cases


def _posts_at_once(case, P: int) -> bool:
    """Whether the ring posts every step's K/V at once for `case` on P ranks (comm.RingComm.eager)."""
    from dilated_attn.ring.comm import RingComm
    from dilated_attn.spec import Problem

    B, N, Hq, Hkv, D = case["shape"]
    p = Problem.from_sizes(B, N // P, Hq, Hkv, D, case.get("w") or [N], case.get("r") or [1], dtype=torch.float64,
                           device="cpu", head_groups=case.get("head_groups", "all"))
    w, r = p.op_branches(N)
    plan = ring_plan(P, N // P, Hq, Hkv, tuple(w), tuple(r), p.head_groups, case.get("causal", False),
                     case.get("layout", "contiguous"))
    return RingComm(plan, 0, None, B, D, "cpu").eager(Hq, Hkv)


def _heads_runs(case, P: int) -> bool:
    """Whether mode='heads' runs `case` on P ranks (its rules: head_groups 'all', Hq % P == 0, whole key/value
    heads per rank, offsets a kernel can take)."""
    from dilated_attn.ring.modes import heads_share
    from dilated_attn.spec import Problem

    B, N, Hq, Hkv, D = case["shape"]
    p = Problem.from_sizes(B, N // P, Hq, Hkv, D, case.get("w") or [N], case.get("r") or [1], dtype=torch.float64,
                           device="cpu", causal=case.get("causal", False), head_groups=case.get("head_groups", "all"))
    try:
        heads_share(p, N, P, 0, case.get("layout", "contiguous"))
    except ValueError:
        return False
    return True


def _mode_cases(P: int, mode: str, inner: int = 0) -> list:
    """The named cases the head-parallel `mode` runs on P ranks (2d: inner groups of `inner` ranks)."""
    cases = [dict(c, name=f"{c['name']} [{mode}]", mode=mode, inner=inner) for c in _named_cases(P)
             if "backend" not in c and not c.get("ring_only") and _heads_runs(c, inner or P)]
    # the test must not shrink unseen (few named cases have a head count divisible by 3)
    assert len(cases) >= (4 if P == 3 else 10), f"only {len(cases)} cases run in mode {mode!r} on {P} ranks"
    return cases


def _random_cases(P, count, seed):
    rng = random.Random(seed)
    cases = []
    for n in range(count):
        layout = rng.choice(["contiguous", "zigzag"])
        L = rng.choice([2, 4, 6, 10]) if layout == "zigzag" else rng.randint(1, 11)
        N = P * L
        Hkv = rng.choice([1, 2])
        Hq = Hkv * rng.choice([1, 2, 3])
        m = rng.randint(1, 3)
        dense = rng.random() < 0.2
        w = None if dense else [rng.choice([rng.randint(1, N), L, 2 * L, N + rng.randint(0, 5)]) for _ in range(m)]
        r = None if dense else [rng.randint(1, 6) for _ in range(m)]
        hg = "split" if not dense and Hq >= m and rng.random() < 0.3 else "all"
        cases.append(dict(name=f"random {n}", shape=(rng.randint(1, 2), N, Hq, Hkv, rng.randint(1, 6)), w=w, r=r,
                          causal=rng.random() < 0.5, layout=layout, head_groups=hg, seed=seed + n))
    return cases


def _check(results, cases):
    failures = []
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            if res:
                failures.append(f"rank {rank} {case}: {res}")
    assert not failures, "\n".join(failures)


def _mismatch(case, rank):
    """Each rank passes a configuration that differs on rank 1; report what was raised."""
    B, N, Hq, Hkv, D = case["shape"]
    L = N // dist.get_world_size()
    field = case["field"]
    L_mine = L + 1 if field == "length" and rank == 1 else L
    dtype = torch.float32 if field == "dtype" and rank == 1 else torch.float64
    q = torch.randn(B, L_mine, Hq, D, dtype=dtype)
    k = torch.randn(B, L_mine, Hkv, D, dtype=dtype)
    kw = dict(causal=field == "causal" and rank == 1)
    w, r = [N], [1]
    if field == "branches" and rank == 1:
        w, r = [N // 2], [1]
    if field == "layout" and rank == 1:
        kw["layout"] = "zigzag"
    if field == "scale" and rank == 1:
        kw["scale"] = 0.25  # the others use the default, head_dim ** -0.5 = 0.5
    if field == "heads" and rank == 1:
        q = torch.randn(B, L_mine, 2 * Hq, D, dtype=dtype)
    if case.get("inner"):
        kw.update(group=_mesh_pair(case["inner"]), mode="2d")
    if field == "return_lse":  # the head-parallel modes send the LSE back only where it is returned
        kw.update(return_lse=rank == 1, mode=case.get("mode", "heads"))
    if field == "offsets":  # a pack whose offsets differ on rank 1
        q, k = q[0], k[0]
        kw["cu_seqlens"] = torch.tensor([0, 5 + (rank == 1), N])
    try:
        dilated_attn.ring_attention(q, k, k, w, r, **kw)
    except ValueError as exc:
        return {"raised": "ValueError", "message": str(exc)}
    return {"raised": None}


def _die(case, rank):
    """Rank 1 dies in the middle of a call (as it posts its first transfer); rank 0 must fail, not hang."""
    import dilated_attn.ring.comm as comm

    if rank == 1:
        def die(*args, **kwargs):
            os._exit(0)  # no cleanup, as in a crash; exit code 0 so that only rank 0's report decides the test

        comm.Step.__init__ = die
    q, k, v, _, _ = _global_inputs(case, torch.float64, "cpu")
    start = time.monotonic()
    try:
        _attention(case, *(_local(x, case) for x in (q, k, v)), ring=True)
    except Exception as exc:  # noqa: BLE001
        return {"raised": type(exc).__name__, "seconds": time.monotonic() - start, "message": str(exc)[:300]}
    return {"raised": None, "seconds": time.monotonic() - start}


def _jitter(case, rank):
    """The same call three times with random delays before every transfer is posted, so messages arrive in
    different orders: outputs and gradients must be the same bits every time."""
    import dilated_attn.ring.comm as comm

    post = comm.Step.__init__
    rng = random.Random(rank)

    def delayed(self, *args, **kwargs):
        time.sleep(rng.random() * 0.02)
        post(self, *args, **kwargs)

    comm.Step.__init__ = delayed
    try:
        q, k, v, go, gl = _global_inputs(case, torch.float64, "cpu")
        local = [_local(x, case) for x in (q, k, v, go)] + [_local(gl, case, dim=2)]
        digests = {zlib.crc32(b"".join(t.numpy().tobytes() for t in _run(case, *local, ring=True)))
                   for _ in range(3)}
    finally:
        comm.Step.__init__ = post
    return {} if len(digests) == 1 else {"differing results": len(digests)}


# Invalid arguments on one rank only ("bad_rank"): every rank must raise, within RAISE_WITHIN_S of its call, naming
# that rank, instead of the others waiting for it in the configuration check until the group's timeout. Each case:
# the arguments of every rank ("args"), those that differ on the bad rank ("bad"), the type that rank raises and a
# piece of the rule's message.
RAISE_WITHIN_S = 10
BAD_RANK_CASES = [
    dict(name="zigzag odd L", bad_rank=1, args=dict(layout="zigzag"), bad=dict(L=17), error="ValueError",
         rule="an even local length L, got L=17"),
    dict(name="dilation rate 0", bad_rank=0, args={}, bad=dict(r=0), error="ValueError",
         rule="dilation_rates[0] must be a positive integer, got 0"),
    dict(name="integer inputs", bad_rank=1, args={}, bad=dict(dtype="int64"), error="TypeError",
         rule="q must have a floating-point dtype, got torch.int64"),
    dict(name="unknown layout", bad_rank=0, args={}, bad=dict(layout="diagonal"), error="ValueError",
         rule="layout must be one of ('contiguous', 'zigzag'), got 'diagonal'"),
    dict(name="unknown mode", bad_rank=1, args={}, bad=dict(mode="both"), error="ValueError",
         rule="mode must be one of ('auto', 'ring', 'heads', '2d'), got 'both'"),
    # the 2-D mode with one group: its peers, which pass one group too, learn it in that group's check
    dict(name="2d without a mesh", bad_rank=0, args={}, bad=dict(mode="2d", group=None), error="ValueError",
         rule="mode='2d' needs group=a 2-D DeviceMesh or the pair"),
]


def _bad_rank(case, rank):
    """One ring_attention call with this rank's arguments: what it raised and how long it took. The case "valid
    call" after the others: the group is still usable and the result exact (its error)."""
    device = f"cuda:{rank}" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    kw = {}
    if case.get("mode") == "2d":
        kw = dict(mode="2d", group=_mesh_pair(2))
    elif case.get("mode"):
        kw = dict(mode=case["mode"])
    if case["name"] == "valid call":
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 16, 4, 4, generator=g, dtype=torch.float64).to(device) for _ in range(3))
        out = dilated_attn.ring_attention(*(dilated_attn.shard(x) for x in (q, k, v)), [4, 16], [1, 2], causal=True,
                                          **kw)
        want = dilated_attn.dilated_attention(q, k, v, [4, 16], [1, 2], causal=True, backend="reference")
        if case.get("mode") == "heads" and dilated_attn.explain_ring(
                *(dilated_attn.shard(x) for x in (q, k, v)), [4, 16], [1, 2], causal=True, **kw).mode != "heads":
            return {"error": "the valid call did not run the heads mode"}
        return {"error": (dilated_attn.unshard(out) - want).abs().max().item()}
    # the group's first collective sets up its communicator (about 10 s with NCCL on some hosts): before the clock
    dist.all_reduce(torch.zeros(1, device=device))
    a = dict(L=16, r=1, dtype="float32", layout="contiguous", device=device)
    a.update(case["args"])
    if rank == case["bad_rank"]:
        a.update(case["bad"])
        kw.update({name: a[name] for name in ("mode", "group") if name in a})
    q = torch.ones(1, a["L"], 4, 4, dtype=getattr(torch, a["dtype"]), device=a["device"])
    start = time.monotonic()
    try:
        dilated_attn.ring_attention(q, q, q, [8], [a["r"]], layout=a["layout"], **kw)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        return {"raised": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def _check_bad_rank(results, cases):
    failures = []
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            if case["name"] == "valid call":
                if not res.get("error", 1.0) < 1e-5:
                    failures.append(f"rank {rank}, a valid call after the errors: {res}")
                continue
            bad = case["bad_rank"]
            if rank == bad:
                want_type, prefix = case["error"], f"ring_attention: rank {bad}: "
            else:
                want_type, prefix = "ValueError", f"ring_attention: rank {bad}'s arguments are invalid: "
            message = res.get("message", "")
            if (res.get("raised") != want_type or not message.startswith(prefix) or case["rule"] not in message
                    or not res["seconds"] < RAISE_WITHIN_S):
                failures.append(f"rank {rank}, {case['name']}: expected {want_type} {prefix!r}...{case['rule']!r} "
                                f"within {RAISE_WITHIN_S} s, got {res}")
    assert not failures, "\n".join(failures)


def _packed_cases(P: int) -> list:
    """Packs of P*L rows whose sequences cross rank boundaries: empty and one-row sequences, segments longer than
    a sequence, dilations that do not divide the lengths, GQA, causal, both layouts."""
    L = 20
    cases = [
        dict(name="pack", lengths=[5, 0, 17, P * L - 22], heads=(4, 2, 3), w=[4, 8], r=[1, 2]),
        dict(name="pack causal zigzag", lengths=[1, 30, P * L - 31], heads=(4, 4, 3), w=[6, 16], r=[1, 3],
             causal=True, layout="zigzag"),
        dict(name="pack MQA, one sequence", lengths=[P * L], heads=(2 * P, 1, 2), w=[3, 2 * L], r=[2, 5],
             causal=True),
        dict(name="pack of short sequences", lengths=[3] * (P * L // 3) + [P * L % 3], heads=(2 * P, 2 * P, 2),
             w=[2, 64], r=[1, 4]),
        # the heads mode runs head_groups "all" only: auto takes this one to the ring
        dict(name="pack split heads causal zigzag", lengths=[7, L + 3, P * L - L - 10], heads=(6, 3, 2),
             w=[4, 9, 32], r=[1, 2, 3], causal=True, layout="zigzag", head_groups="split", ran="ring"),
    ]
    for c in cases:  # (Hq, Hkv, D) as a batch of one
        c.update(shape=(1, P * L, *c.pop("heads")), seed=zlib.crc32(c["name"].encode()))
    return cases


def _twice(case, rank):
    """Two backwards through one graph, the first retaining it, with different output gradients: each gives the
    gradients that dilated_attention's graph gives (its own, not their sum)."""
    global _GROUP
    _GROUP = _mesh_pair(case["inner"]) if case.get("mode") == "2d" else None
    case = _placed(case)
    try:
        q, k, v, go, _ = _global_inputs(case, torch.float64, "cpu")
        go2 = torch.randn(go.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
        results = []
        for ring in (False, True):
            inputs = [_local(x, case) if ring else x for x in (q, k, v, go, go2)]
            leaves = [x.detach().clone().requires_grad_() for x in inputs[:3]]
            out, _ = _attention(case, *leaves, ring=ring, backend="cpu")
            grads = []
            for d_out, retain in ((inputs[3], True), (inputs[4], False)):
                out.backward(d_out, retain_graph=retain)
                grads += [x.grad.clone() for x in leaves]
                for x in leaves:
                    x.grad = None
            results.append(grads)
        want, got = results
        errors = {}
        for n, (a, b) in enumerate(zip(got, want)):
            err = (a - _local(b, case)).abs().max().item()
            if not err <= TOL_F64:
                errors[f"backward {n // 3 + 1}, d{'qkv'[n % 3]}"] = err
        return errors
    finally:
        _GROUP = None


def _release(case, rank):
    """ring_attention with group=dist.group.WORLD in every mode, packed and not, then destroy_process_group: the
    package must not keep the group alive (gloo's teardown of a group that outlives it can abort the process)."""
    import gc
    import weakref

    world = dist.group.WORLD
    q, k, v, _, _ = _global_inputs(case, torch.float64, "cpu")
    local = [_local(x, case).requires_grad_() for x in (q, k, v)]
    cu = _pack_offsets(dict(lengths=[5, q.shape[1] - 5]), "cpu")
    for mode in ("ring", "heads"):
        dilated_attn.ring_attention(*local, case["w"], case["r"], group=world, mode=mode).sum().backward()
        dilated_attn.ring_attention(*(x[0] for x in local), case["w"], case["r"], group=world, mode=mode,
                                    cu_seqlens=cu).sum().backward()
    kept = weakref.ref(world)
    del world
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return {} if kept() is None else {"kept": "the group outlived destroy_process_group"}


def _document_cases(P: int) -> list:
    """Packs under a DocumentLayout (layout="documents"): documents whole on their ranks; long ones cut where no
    segment crosses; long ones that no cut fits (dense, or a segment as long as the document) shared by a ring of
    ranks (zigzag chunks where causal); empty ranks; GQA, MQA, split heads, no LSE gradient."""
    cases = [
        dict(name="documents whole", lengths=[9, 3, 14, 1, 6, 11, 4, 8, 2, 7], heads=(4, 2, 3), w=[4, 8], r=[1, 2],
             causal=True),
        dict(name="documents cut where no segment crosses", lengths=[5, 12 * P + 3, 2, 7], heads=(4, 4, 3), w=[2, 4],
             r=[1, 2]),
        dict(name="dense documents shared, causal", lengths=[3, 10 * P + 1, 5, 0, 4], heads=(4, 2, 3), causal=True),
        dict(name="dense documents shared", lengths=[6 * P - 1, 2, 6 * P + 3], heads=(2, 1, 2)),
        dict(name="segments spanning a shared document", lengths=[11 * P, 3, 2], heads=(6, 3, 2), w=[3, 64],
             r=[1, 3], causal=True),
        dict(name="split heads, shared and whole", lengths=[4, 9 * P, 5, 1], heads=(4, 2, 2), w=[2, 64], r=[1, 2],
             head_groups="split", causal=True),
        dict(name="fewer rows than ranks", lengths=[0, 1, 0, P - 2], heads=(2, 2, 2), w=[2], r=[1]),
        dict(name="documents, no LSE gradient", lengths=[7, 8 * P, 5], heads=(4, 1, 3), w=[4, 16], r=[1, 4],
             causal=True, lse_gradient=False),
    ]
    for c in cases:
        c.update(shape=(1, sum(c["lengths"]), *c.pop("heads")), layout="documents", ran="ring",
                 seed=zlib.crc32(c["name"].encode()))
    return cases


def _early(case, rank):
    """A case compared with the reference (_compare_f64) while the forward's order is logged: the configuration
    check's post and read, and each block's number of query columns."""
    import dilated_attn.ring.autograd as ring_autograd
    import dilated_attn.ring.check as ring_check

    log = []
    block, post, read = ring_autograd.block_forward, ring_check._post_config, ring_check.check_same_config

    def logged_block(ops, q, *args, **kw):
        log.append(["block", q.shape[2]])
        return block(ops, q, *args, **kw)

    ring_autograd.block_forward = logged_block
    ring_check._post_config = lambda *a, **kw: log.append(["check posted"]) or post(*a, **kw)
    ring_check.check_same_config = lambda *a, **kw: log.append(["check read"]) or read(*a, **kw)
    try:
        errors = _compare_f64(case, rank)
    finally:
        ring_autograd.block_forward, ring_check._post_config, ring_check.check_same_config = block, post, read
    return {"errors": errors, "log": log}


JOBS = {"compare_f64": _compare_f64, "mismatch": _mismatch, "die": _die, "jitter": _jitter, "bad_rank": _bad_rank,
        "twice": _twice, "release": _release, "early": _early}


# ---------------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_dilated_attention_gloo(world, tmp_path):
    """The ring mode, its K/V posted at once where local branches hide them and they are few, else step by step;
    on 4 ranks the named cases of the first kind also step by step."""
    cases = ([dict(c, mode="ring") for c in _named_cases(world)]
             + [dict(c, mode="ring") for c in _random_cases(world, 24 if world == 2 else 12, seed=world)]
             + [dict(c, mode="ring", stepwise=True, name=f"{c['name']} [stepwise]") for c in _named_cases(world)
                if world == 4 and _posts_at_once(c, world)])
    _check(_spawn(world, "gloo", "compare_f64", cases, tmp_path), cases)


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_sums_start_unwritten_gloo(world, tmp_path):
    """The backward's float32 sums (blocks.Sums) start as uninitialised memory, here NaN: each row is stored by the
    first block that reaches it and added by the later ones, in both schedules (every step posted at once, and step
    by step). (Every row of a plan is reached by some block; Sums.finish zeroes any that is not: test_sums.)"""
    cases = [dict(c, mode="ring", poisoned=True, name=f"{c['name']} [poisoned]") for c in _named_cases(world)]
    cases += [dict(c, stepwise=True, name=f"{c['name']} [stepwise]") for c in cases if _posts_at_once(c, world)]
    _check(_spawn(world, "gloo", "compare_f64", cases, tmp_path), cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_head_parallel_modes_match_dilated_attention_gloo(world, tmp_path):
    """The heads mode on 2, 3 and 4 ranks; on 4 also the 2-D mode as 2 x 2 (heads across each pair of consecutive
    ranks, ring across the pairs), in the same world."""
    cases = _mode_cases(world, "heads") + (_mode_cases(4, "2d", inner=2) if world == 4 else [])
    _check(_spawn(world, "gloo", "compare_f64", cases, tmp_path), cases)


@pytest.mark.parametrize("world", [2, 4])
def test_packed_sequences_match_dilated_attention_varlen_gloo(world, tmp_path):
    """ring_attention on the shards of a pack (cu_seqlens) equals dilated_attention_varlen on the whole pack: out, LSE
    and gradients, sequences crossing ranks, in every mode: auto (the heads mode), ring, and on 4 ranks 2d (2 x 2).
    Also (one process) the shards must be 3-D."""
    cases = _packed_cases(world)
    cases += [dict(c, mode="ring", name=f"{c['name']} [ring]") for c in cases if c.get("ran") != "ring"]
    if world == 4:
        cases += [dict(c, mode="2d", inner=2, name=f"{c['name']} [2d]") for c in _packed_cases(world)
                  if c["shape"][2] % 2 == 0 and c.get("head_groups") != "split"]
    _check(_spawn(world, "gloo", "compare_f64", cases, tmp_path), cases)
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="must be 3-D \\[total_tokens, heads, head_dim\\]"):
        dilated_attn.ring_attention(q[None], q[None], q[None], [4], [1], cu_seqlens=torch.tensor([0, 3, 8]))


def test_lse_gradient_on_some_ranks_only_gloo(tmp_path):
    """return_lse=True where only some ranks' losses use the LSE: exact gradients in every mode (each rank's
    backward must take part in the same exchanges whether or not its LSE has a gradient)."""
    P = 4
    named = [c for c in _named_cases(P) if c["name"] == "mixed causal zigzag"]
    packed = [c for c in _packed_cases(P) if c["name"] == "pack"]
    cases = [dict(c, mode=mode, inner=2 if mode == "2d" else 0, lse_gradient_ranks=ranks,
                  name=f"{c['name']} [{mode}, LSE gradient on ranks {ranks}]")
             for c in named + packed for mode in ("ring", "heads", "2d") for ranks in ([0], [1, 3])]
    _check(_spawn(P, "gloo", "compare_f64", cases, tmp_path), cases)


def test_second_backward_through_one_graph_gloo(tmp_path):
    """A second backward through a retained ring_attention graph gives the exact gradients, in every mode, packed
    and not."""
    P = 4
    named = [c for c in _named_cases(P) if c["name"] in ("mixed causal zigzag", "LongNet, joined blocks")]
    packed = [c for c in _packed_cases(P) if c["name"] == "pack"]
    cases = [dict(c, mode=mode, inner=2 if mode == "2d" else 0, name=f"{c['name']} [{mode}]")
             for c in named + packed for mode in ("ring", "heads", "2d")]
    _check(_spawn(P, "gloo", "twice", cases, tmp_path), cases)


def test_a_group_is_not_kept_alive_gloo(tmp_path):
    case = dict(shape=(1, 16, 4, 2, 3), w=[4, 16], r=[1, 2])
    _check(_spawn(2, "gloo", "release", [case], tmp_path), [case])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_documents_layout_matches_dilated_attention_varlen_gloo(world, tmp_path):
    """ring_attention under a DocumentLayout equals dilated_attention_varlen on the whole pack at each rank's rows:
    out, LSE and gradients; on 4 ranks also a second backward through a retained graph."""
    cases = _document_cases(world)
    _check(_spawn(world, "gloo", "compare_f64", cases, tmp_path), cases)
    if world == 4:
        twice = [c for c in cases if c["name"] in ("dense documents shared, causal", "documents whole")]
        _check(_spawn(world, "gloo", "twice", twice, tmp_path), twice)


def test_ring_on_subgroups_gloo(tmp_path):
    """Four ranks as two independent 2-rank groups (peers addressed by their global ranks)."""
    cases = [dict(c, subgroups=True) for c in _named_cases(2) if c["name"] in (
        "dense causal zigzag", "dilated spanning", "mixed causal", "unaligned segments")]
    _check(_spawn(4, "gloo", "compare_f64", cases, tmp_path), cases)


def test_ring_three_ranks_gloo(tmp_path):
    cases = [dict(c, stepwise=stepwise) for c in _named_cases(3) if "zigzag" in c["name"] or "unaligned" in c["name"]
             for stepwise in (False, True)]
    _check(_spawn(3, "gloo", "compare_f64", cases, tmp_path), cases)


def test_mismatched_configuration_raises_on_every_rank(tmp_path):
    fields = ["length", "dtype", "causal", "branches", "layout", "scale", "heads", "offsets", "return_lse"]
    cases = [dict(shape=(1, 16, 2, 2, 4), field=f) for f in fields]
    results = _spawn(2, "gloo", "mismatch", cases, tmp_path)
    for rank, per_rank in enumerate(results):
        for field, res in zip(fields, per_rank):
            assert res.get("raised") == "ValueError", (rank, field, res)
            assert "every rank" in res["message"] or "same" in res["message"], (rank, field, res)


def test_mismatched_configuration_raises_on_every_rank_2d(tmp_path):
    """2 x 2: ranks 0 and 1 (one inner group) differ; ranks 2 and 3, whose own group agrees, raise too."""
    fields = ["length", "causal", "branches", "scale", "return_lse"]
    cases = [dict(shape=(1, 16, 2, 2, 4), field=f, inner=2, mode="2d") for f in fields]
    results = _spawn(4, "gloo", "mismatch", cases, tmp_path)
    for rank, per_rank in enumerate(results):
        for field, res in zip(fields, per_rank):
            assert res.get("raised") == "ValueError", (rank, field, res)
            assert "same" in res["message"], (rank, field, res)


def test_bad_arguments_on_one_rank_raise_on_every_rank_gloo(tmp_path):
    cases = [*BAD_RANK_CASES, dict(name="valid call")]
    _check_bad_rank(_spawn(2, "gloo", "bad_rank", cases, tmp_path), cases)


def test_bad_arguments_on_one_rank_raise_on_every_rank_head_modes_gloo(tmp_path):
    """The head-parallel modes on 4 ranks (2d: 2 x 2, where the bad rank shares a group with only some peers; a
    rank passing one group where its peers pass a pair has no check in common with them: not a case)."""
    cases = [dict(c, mode=mode) for mode in ("heads", "2d") for c in [*BAD_RANK_CASES, dict(name="valid call")]
             if not (mode == "2d" and "group" in c.get("bad", {}))]
    _check_bad_rank(_spawn(4, "gloo", "bad_rank", cases, tmp_path), cases)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_bad_arguments_on_one_rank_raise_on_every_rank_nccl(tmp_path):
    # odd L under zigzag; and integer CPU inputs on one rank, where the gather must still use a CUDA tensor
    cases = [BAD_RANK_CASES[0], dict(BAD_RANK_CASES[2], bad=dict(dtype="int64", device="cpu")), dict(name="valid call")]
    _check_bad_rank(_spawn(2, "nccl", "bad_rank", cases, tmp_path), cases)


def test_rank_dying_mid_call_fails_the_others(tmp_path):
    """A rank that dies while the others wait for its transfer: they raise (gloo notices the closed
    connection, or the group's timeout expires), within the timeout, instead of hanging."""
    case = dict(shape=(1, 16, 2, 2, 4), w=[16], r=[2], causal=True)
    results = _spawn(2, "gloo", "die", [case], tmp_path)
    report = results[0][0]
    assert report["raised"] is not None, report
    assert report["seconds"] < PG_TIMEOUT_S + 10, report
    print(f"rank 0 raised {report['raised']} after {report['seconds']:.2f} s: {report.get('message', '')[:120]}")


def test_result_does_not_depend_on_arrival_order(tmp_path):
    cases = [dict(name="dense causal zigzag", shape=(1, 24, 4, 2, 3), causal=True, layout="zigzag"),
             dict(name="spanning", shape=(2, 24, 4, 2, 3), w=[6, 24], r=[2, 3], causal=True)]
    _check(_spawn(4, "gloo", "jitter", cases, tmp_path), cases)


def test_dense_forward_computes_while_the_check_is_read(tmp_path):
    """Dense attention has no local branches to compute while the host waits for the configuration check: the first
    quarter of the own block's heads runs between the check's post and its read (autograd._early_heads), the rest
    after it; GQA keeps each kv head with its query heads, MQA splits the query heads."""
    cases = [dict(name="dense causal zigzag", shape=(2, 16, 8, 8, 3), causal=True, layout="zigzag"),
             dict(name="dense, GQA", shape=(1, 16, 8, 4, 3)), dict(name="dense causal, MQA", shape=(1, 16, 4, 1, 3),
                                                                  causal=True)]
    results = _spawn(2, "gloo", "early", cases, tmp_path)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            assert res.get("errors") == {}, (rank, case["name"], res)
            H = case["shape"][2]
            # the query columns first: 8 kv heads of 8 query heads, 2 of them; 4 of 8, one with its 2; 1 of 4, 1
            first = {8: 2, 4: 2, 1: 1}[case["shape"][3]]
            assert res["log"][:4] == [["check posted"], ["block", first], ["check read"], ["block", H - first]], (
                rank, case["name"], res["log"])


def test_sums():
    """blocks.Sums: the first part to reach a row is stored (the memory's NaN never read), later parts added, the
    rows no part reached zeroed by finish(); `[:, lo:hi]` slices rows as a tensor's [:, lo:hi] would."""
    from dilated_attn.ring.blocks import Sums, accumulate

    sums = Sums(torch.full((2, 10, 3, 4), math.nan, dtype=torch.float64))
    want = torch.zeros(2, 10, 3, 4, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for a, b in ((2, 5), (4, 8), (3, 4), (8, 8)):
        part = torch.randn(2, b - a, 3, 4, generator=g, dtype=torch.float64)
        accumulate([sums[:, 1:][:, a - 1:b - 1]], [part])
        want[:, a:b] += part
    torch.testing.assert_close(sums.finish(), want, rtol=0, atol=0)
    with pytest.raises(IndexError, match=r"\[:, lo:hi\]"):
        sums[:, ::2]


def test_one_process_is_dilated_attention():
    case = dict(shape=(1, 12, 4, 2, 3), w=[4, 12], r=[1, 2], causal=True)
    q, k, v, go, gl = _global_inputs(case, torch.float64, "cpu")
    want = _run(case, q, k, v, go, gl, ring=False, backend="cpu")
    got = _run(case, q, k, v, go, gl, ring=True, backend="cpu")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_repeated_call_is_planned_once(monkeypatch):
    """ring_attention keeps a call's plan under everything the plan reads: the same call again is not validated and
    planned again; a call that differs in any of those is, and one with invalid arguments still raises."""
    import dilated_attn.ring as ring

    planned = []
    plan_call = ring.plan_call
    monkeypatch.setattr(ring, "plan_call", lambda *a, **kw: planned.append(1) or plan_call(*a, **kw))
    monkeypatch.setattr(ring, "_PLANS", {})
    monkeypatch.delenv("DILATED_ATTN_BACKEND", raising=False)
    q = torch.randn(1, 16, 2, 4, dtype=torch.float64)
    leaf = q.clone().requires_grad_()

    def count(x=q, w=(8,), r=(2,), **kw):
        dilated_attn.ring_attention(x, x, x, w, r, **kw)
        return len(planned)

    count()  # loads the backends it runs: a finished load is part of the key (dispatch.state)
    planned.clear()
    ring._PLANS.clear()
    assert count() == 1 and count() == 1
    assert count(causal=True) == 2 and count(causal=True) == 2 and count() == 2
    assert count(x=q[:, :8]) == 3  # another length
    assert count(x=leaf) == 4  # records its backward
    with torch.no_grad():
        assert count(x=leaf) == 5
    monkeypatch.setenv("DILATED_ATTN_BACKEND", "reference")  # what the dispatch reads
    assert count() == 6 and count() == 6
    assert count(w=torch.tensor([8])) == 7 and count(w=torch.tensor([8])) == 8  # not plain data: never kept
    for _ in range(2):
        with pytest.raises(ValueError, match="dilation_rates"):
            count(r=(0,))
    with pytest.raises(TypeError, match="causal must be a bool"):  # equal to causal=True as a value, not valid
        count(causal=1)
    assert len(planned) == 11
    monkeypatch.setattr(ring, "_PLANS_KEPT", 2)  # a bounded number kept: more configurations start afresh
    for length in (4, 8, 12, 16):
        count(x=q[:, :length])
        assert len(ring._PLANS) <= 2


def test_shard_round_trip_single_process():
    x = torch.randn(2, 12, 3, 4)
    for layout in ("contiguous", "zigzag"):
        assert torch.equal(dilated_attn.shard(x, layout=layout), x)
        assert torch.equal(dilated_attn.unshard(x, layout=layout), x)
    assert torch.equal(dilated_attn.shard(x, dim=-3), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_head_exchange_copies_are_exact(dtype):
    """The heads mode's strided copies (heads._copy: 8-byte words where the views allow) equal copy_ bit for bit,
    and leave what is beside the destination view untouched: the exchange's own views (a share of the heads of
    every rank, the zigzag halves, the chunks reversed), views whose last dim holds no whole word or is strided
    (copied element by element), and a copy that converts."""
    from dilated_attn.ring.heads import _copy

    g = torch.Generator().manual_seed(7)
    x = (torch.randint(0, 255, (2, 6, 12, 8), generator=g).to(dtype) if dtype == torch.uint8
         else torch.randn(2, 6, 12, 8, generator=g).to(dtype))
    cases = [
        (lambda d: d, lambda s: s[:, :, 4:12].unflatten(2, (2, 4)).permute(2, 0, 1, 3, 4), (2, 2, 6, 4, 8)),
        (lambda d: d[:, 1:3], lambda s: s.view(2, 2, 3, 12, 8)[:, :, 1].flip(0).transpose(0, 1), (2, 4, 12, 8)),
        (lambda d: d[..., :3], lambda s: s[..., 2:5], (2, 6, 12, 5)),  # 3 elements: no whole word
        (lambda d: d[..., ::2], lambda s: s[..., 1::2], (2, 6, 12, 8)),  # strided last dim
        (lambda d: d.transpose(1, 2), lambda s: s.transpose(1, 2).contiguous().transpose(1, 2), (2, 12, 6, 8)),
    ]
    for dst_view, src_view, shape in cases:
        want = torch.full(shape, 3, dtype=dtype)
        got = want.clone()
        dst_view(want).copy_(src_view(x))
        _copy(dst_view(got), src_view(x))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    converted = torch.empty(2, 6, 12, 8, dtype=torch.float64)
    _copy(converted.transpose(1, 2), x.transpose(1, 2))
    assert torch.equal(converted, x.to(torch.float64))


@pytest.mark.parametrize("dim, error", [(7, ValueError), (-5, ValueError), (1.0, TypeError), (True, TypeError)])
@pytest.mark.parametrize("fn", [dilated_attn.shard, dilated_attn.unshard])
def test_shard_dim_outside_the_tensor_is_refused(fn, dim, error):
    with pytest.raises(error, match="dim must be"):
        fn(torch.randn(2, 12, 3, 4), dim=dim)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(layout="diagonal"), ValueError, "layout"),
        (dict(layout=3), TypeError, "layout"),
        (dict(segment_lengths=[4]), ValueError, "both be None"),
        (dict(dilation_rates=[1]), ValueError, "both be None"),
        (dict(layout="zigzag", odd=True), ValueError, "zigzag"),
        (dict(group="world"), TypeError, "group"),
        (dict(segment_lengths=[0], dilation_rates=[1]), ValueError, "segment_lengths"),
        (dict(causal=1), TypeError, "causal"),
        (dict(backend="fast"), ValueError, "backend"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    N = 7 if kwargs.pop("odd", False) else 8
    q = torch.randn(1, N, 2, 4)
    with pytest.raises(error, match=match):
        dilated_attn.ring_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("P", [2, 4])
def test_joined_blocks(P):
    """The named case "LongNet, joined blocks" posts every step at once and joins each head stack's blocks into
    one (so that its parity run covers them), its rows are strided views, and a causal stack's own block stays
    apart while its received blocks join."""
    from dilated_attn.ring.autograd import compacted_rows, joined_blocks

    case = next(c for c in _named_cases(P) if c["name"] == "LongNet, joined blocks")
    B, N, H, _, D = case["shape"]
    L = N // P
    assert _posts_at_once(case, P)
    plan = ring_plan(P, L, H, H, (4, L, N), (1, 2, 4), "all", False, "contiguous")
    for rank in range(P):
        (joined,) = joined_blocks(plan, rank).values()
        assert joined.steps == tuple(range(P)) and joined.q == slice(0, L // 4) and joined.whole
        (rows,) = compacted_rows(plan, rank, torch.device("cpu"))
        x = torch.randn(B, L, H, D)
        for rs in (rows.q, rows.kv):
            indexed = torch.stack([x[:, r, h] for r, h in zip(plan.stacks[0].rows(rank, plan.stacks[0].q_offsets),
                                                               plan.stacks[0].q_heads)], 2)
            assert rs.is_view and torch.equal(rs.gather(x), indexed)
    causal = ring_plan(4, 8, 4, 4, (32,), (2,), "all", True, "zigzag")
    assert [(j.steps, j.whole) for j in joined_blocks(causal, 0).values()] == [((1, 2, 3), False)]


def test_traffic_is_what_the_branches_select():
    """Local branches send nothing; a spanning branch sends 1/r of K and V, to the ranks that read it."""
    B, L, H, D, item = 1, 64, 4, 8, 2
    local = ring_plan(2, L, H, H, (16, 64), (1, 2), "all", False, "contiguous")
    assert local.local_branches == [0, 1] and local.bytes_sent(0, B, D, item) == 0
    for r in (1, 2, 4, 8):
        plan = ring_plan(2, L, H, H, (2 * L,), (r,), "all", False, "contiguous")
        for rank in (0, 1):
            assert plan.bytes_sent(rank, B, D, item) == 2 * B * (L // r) * H * D * item, r
    # causal, contiguous: keys only flow to later ranks, so the last rank sends nothing
    causal = ring_plan(4, L, H, H, (4 * L,), (1,), "all", True, "contiguous")
    sent = [causal.bytes_sent(j, B, D, item) for j in range(4)]
    assert sent == [2 * B * L * H * D * item * (3 - j) for j in range(4)]
    # GQA: kv heads travel once, not once per query head
    gqa = ring_plan(2, L, 8, 2, (2 * L,), (1,), "all", False, "contiguous")
    assert gqa.bytes_sent(0, B, D, item) == 2 * B * L * 2 * D * item


def test_packed_plan_runs_each_sequence_in_place():
    """With packed sequences every segment is a range of its sequence (segment_ranges). Segments within a rank's
    chunk move nothing and run as internal runs of the branch (each run whole segments but its last); a segment
    that crosses ranks is a head stack, and sends exactly its members; "split" heads run every segment as stacks,
    a rank's own consecutive segments of a stack in one task (seg_len)."""
    assert segment_ranges(4, 20, (0, 5, 5, 17, 20)) == [(0, 4), (4, 5), (5, 9), (9, 13), (13, 17), (17, 20)]
    B, L, H, D, item = 1, 64, 4, 8, 2
    inside = ring_plan(2, L, H, H, (16,), (2,), "all", False, "contiguous", offsets=(0, 40, 64, 128))
    assert inside.local_branches == [] and inside.stacks == []
    assert inside.bytes_sent(0, B, D, item) == inside.bytes_sent(1, B, D, item) == 0
    # rank 0: rows 0-39 as segments of 16, 16, 8 and rows 40-63 as 16, 8: one run of two parts (the op starts
    # segments afresh after the short one); rank 1 one run of four whole segments, one part
    (run,) = inside.runs[0]
    assert (run.start, run.stop, run.seg_len, run.dilation, run.parts()) == (0, 64, 16, 2, [(0, 40), (40, 64)])
    assert [(u.start, u.stop, u.parts()) for u in inside.runs[1]] == [(0, 64, [(0, 64)])]
    # one sequence of 2L - 8 rows from row 8, the branch (2L, 2): rank 1 reads rank 0's members of rows 8-63
    crossing = ring_plan(2, L, H, H, (2 * L,), (2,), "all", False, "contiguous", offsets=(0, 8, 2 * L))
    assert crossing.runs == [[BranchRun(2 * L, 2, 0, 8, (0, 8))], []] and len(crossing.stacks) == 1
    assert crossing.bytes_sent(0, B, D, item) == 2 * B * (L - 8) // 2 * H * D * item
    split = ring_plan(2, L, 2, 2, (16, 16), (1, 1), "split", False, "contiguous", offsets=(0, 40, 64, 128))
    assert split.runs == [[], []] and split.bytes_sent(0, B, D, item) == 0
    assert [(t.q_start, t.q_stop, t.seg_len) for t in split.tasks[0][0] if t.stack == 0] == [(0, 40, 16), (40, 64, 16)]


@pytest.mark.skipif(torch.cuda.is_available() or not dilated_attn.backends.triton.interpreting()
                    or dilated_attn.backends.TRITON.unavailable() is not None,
                    reason="Triton's interpreter, where there is no GPU")
def test_internal_run_in_one_packed_call():
    """An internal run of several parts (a packed sequence's short last segment, then the next sequence) runs in
    one call of a backend's packed ops (triton's, under the interpreter) and gives what one call per part gives
    (the cpu backend's): out and LSE merged into running results, and the gradients added."""
    from dilated_attn.ring.blocks import block_ops, run_backward, run_forward

    L, H, D = 20, 4, 16
    run = BranchRun(4, 2, 3, 16, (0, 5, 13))  # rows 3-15: a sequence of 5 rows (segments 4, 1), then one of 8
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out, out0 = (torch.randn(1, L, H, D, generator=g) for _ in range(5))
    lse0, d_lse = torch.randn(1, H, L, generator=g), torch.randn(1, H, L, generator=g)
    arguments = dict(segment_lengths=[4], dilation_rates=[2], split_heads=False, causal=True, scale=D ** -0.5,
                     head_start=0, global_heads=0)
    results = []
    for name in ("triton", "cpu"):
        ops = block_ops(name, D)
        assert (ops.varlen is not None) == (name == "triton")
        out, lse = out0.clone(), lse0.clone()
        run_forward(ops, run, q, k, v, out, lse, arguments)
        grads = tuple(torch.zeros(x.shape) for x in (q, k, v))
        run_backward(ops, run, q, k, v, out, lse, d_out, d_lse, arguments, grads)
        results.append((out, lse) + grads)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert (a - b).abs().max().item() <= 1e-4, name  # float32: the kernels' and the cpu backend's sums
    assert not torch.equal(results[1][0], out0) and results[1][2].abs().sum() > 0  # the run did something


def _compare_gpu(case, rank):
    """bf16 on NCCL: ring vs single-GPU dilated_attention, both against the float64 reference."""
    global _GROUP
    _GROUP = _mesh_pair(case["inner"]) if case.get("mode") == "2d" else None
    try:
        return _compare_gpu_in_group(_placed(case), rank)
    finally:
        _GROUP = None


def _compare_gpu_in_group(case, rank):
    device = torch.device("cuda", rank)
    q, k, v, go, gl = _global_inputs(case, torch.float64, device)
    exact = _run(case, q, k, v, go, gl, ring=False, backend="reference")
    low = [x.to(torch.bfloat16) for x in (q, k, v, go)]
    single = _run(case, *low, gl.float(), ring=False)
    ring = _run(case, *(_local(x, case) for x in low), _local(gl.float(), case, dim=2), ring=True)
    errors = {}
    for name, a, s, e, dim in zip(("out", "lse", "dq", "dk", "dv"), ring, single, exact, (1, 2, 1, 1, 1)):
        s, e = _local(s, case, dim).double(), _local(e, case, dim)
        a = a.double()
        ok = torch.isfinite(e)
        err_ring = (a[ok] - e[ok]).abs().max().item()
        err_single = (s[ok] - e[ok]).abs().max().item()
        # bf16 has 8 mantissa bits: the ring rounds partial outputs/gradients at other points than the
        # single-GPU kernel, so allow twice its error plus a floor of a few bf16 ulps of O(1) values.
        if not err_ring <= 2 * err_single + 1e-2 * e[ok].abs().max().item():
            errors[name] = (err_ring, err_single)
    return errors


JOBS["compare_gpu"] = _compare_gpu


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ring_matches_single_gpu_nccl(tmp_path):
    world = min(torch.cuda.device_count(), 4)
    L = 512
    N = world * L
    cases = [
        dict(name="dense causal zigzag", shape=(2, N, 8, 2, 64), causal=True, layout="zigzag"),
        dict(name="dense", shape=(2, N, 4, 4, 128)),
        dict(name="LongNet branches", shape=(2, N, 8, 8, 128), w=[256, L, N], r=[1, 2, 4]),
        dict(name="LongNet causal zigzag", shape=(2, N, 8, 4, 64), w=[128, 2 * L, N], r=[1, 2, 8], causal=True,
             layout="zigzag"),
        dict(name="MQA, short zigzag segments", shape=(2, N, 8, 1, 64), w=[96, 2 * L], r=[1, 4], layout="zigzag"),
        dict(name="unaligned split", shape=(1, N, 6, 3, 64), w=[300, 3 * L + 5], r=[3, 5], head_groups="split",
             causal=True),
    ]
    if torch.cuda.get_device_capability() >= (8, 0):  # the cudnn backend's blocks, with and without an LSE gradient
        cases += [
            dict(name="cudnn dense causal zigzag", shape=(1, N, 8, 8, 128), causal=True, layout="zigzag",
                 backend="cudnn", lse_gradient=False),
            dict(name="cudnn LongNet GQA", shape=(1, N, 8, 2, 128), w=[256, L, N], r=[1, 2, 4], backend="cudnn",
                 lse_gradient=False),
            # each head stack's blocks joined into one cuDNN call over every rank's keys (test_joined_blocks)
            dict(name="cudnn LongNet, joined blocks", shape=(1, N, 8, 8, 128), w=[256, L, N], r=[1, 2, 8],
                 backend="cudnn", lse_gradient=False),
            dict(name="cudnn LongNet, LSE gradient", shape=(1, N, 8, 4, 64), w=[128, 2 * L, N], r=[1, 2, 8],
                 causal=True, layout="zigzag", backend="cudnn"),
        ]
    # packed sequences crossing ranks, on auto's single-GPU backend (cudnn, fa4 or triton blocks) and on triton's
    cases += [
        dict(name=f"pack, {backend}", shape=(1, N, 8, 2, 128), lengths=[100, N - 612, 512], w=[256, L, N], r=[1, 2, 4],
             causal=True, layout="zigzag", backend=backend) for backend in ("auto", "triton")]
    # every case in the ring mode; those the head-parallel modes run in them too (2d: 2 x 2 on 4 GPUs)
    modes = [("heads", 0)] + ([("2d", 2)] if world == 4 else [])
    cases = [dict(c, mode="ring") for c in cases] + [
        dict(c, name=f"{c['name']} [{mode}]", mode=mode, inner=inner) for mode, inner in modes for c in cases
        if _heads_runs(c, inner or world)]
    # packs under a DocumentLayout (auto's mode): documents whole on their ranks in the backend's packed call, and a
    # dense causal document shared by a ring
    cases += [
        dict(name=f"documents, {backend}", shape=(1, N, 8, 2, 128), lengths=[100, N - 612, 512], w=[256, L, N],
             r=[1, 2, 4], causal=True, layout="documents", backend=backend) for backend in ("auto", "triton")]
    cases.append(dict(name="documents, a dense causal one shared", shape=(1, N, 8, 4, 128),
                      lengths=[N - 300, 200, 100], causal=True, layout="documents"))
    _check(_spawn(world, "nccl", "compare_gpu", cases, tmp_path), cases)


def _module(case, rank):
    """MultiheadDilatedAttention with process_group: this rank's output and input gradients equal the
    single-process module's on the full sequence (same weights), at this rank's positions."""
    B, N, H, Hkv, D = case["shape"]
    kw = dict(num_kv_heads=Hkv, dtype=torch.float64)
    torch.manual_seed(0)
    full = dilated_attn.MultiheadDilatedAttention(H * D, H, case["r"], case["w"], **kw)
    torch.manual_seed(0)
    group = _mesh_pair(case["inner"]) if case.get("inner") else dist.group.WORLD
    ring = dilated_attn.MultiheadDilatedAttention(H * D, H, case["r"], case["w"], **kw, process_group=group,
                                                  layout=case["layout"])
    x = torch.randn(B, N, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(B, N, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xf, xl = x.clone().requires_grad_(), _local(x, case).requires_grad_()
    out_full, _ = full(xf, is_causal=case["causal"])
    out_ring, _ = ring(xl, is_causal=case["causal"])
    out_full.backward(g)
    out_ring.backward(_local(g, case))
    errors = {}
    for name, a, b in (("out", out_ring, _local(out_full, case)), ("dx", xl.grad, _local(xf.grad, case))):
        err = (a - b).abs().max().item()
        if not err <= TOL_F64:
            errors[name] = err
    # weight gradients: each rank has its shard's share; summed over ranks they equal the full module's
    for (name, pf), (_, pr) in zip(full.named_parameters(), ring.named_parameters()):
        total = pr.grad.clone()
        dist.all_reduce(total)
        err = (total - pf.grad).abs().max().item()
        if not err <= TOL_F64 * 10:
            errors[name] = err
    return errors


JOBS["module"] = _module


def test_module_with_process_group(tmp_path):
    cases = [dict(shape=(2, 16, 4, 2, 3), w=[4, 16], r=[1, 2], causal=True, layout="zigzag"),
             dict(shape=(1, 16, 4, 4, 2), w=[8, 16], r=[2, 4], causal=False, layout="contiguous")]
    _check(_spawn(2, "gloo", "module", cases, tmp_path), cases)


def test_module_with_a_2d_group(tmp_path):
    """The module's process_group as the pair (ring_group, heads_group): auto runs the 2-D mode, 2 x 2."""
    cases = [dict(shape=(2, 32, 4, 2, 3), w=[4, 32], r=[1, 2], causal=True, layout="zigzag", inner=2)]
    _check(_spawn(4, "gloo", "module", cases, tmp_path), cases)


def test_module_ring_arguments_are_checked():
    with pytest.raises(TypeError, match="process_group"):
        dilated_attn.DilatedAttention([4], [1], process_group="world")
    with pytest.raises(ValueError, match="layout"):
        dilated_attn.DilatedAttention([4], [1], layout="spiral")
    if dist.is_available():
        group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # construction-time checks need no live group
        with pytest.raises(ValueError, match="dropout"):
            dilated_attn.DilatedAttention([4], [1], attention_dropout=0.1, process_group=group)
        with pytest.raises(ValueError, match="spatial_shape"):
            dilated_attn.MultiheadDilatedAttention(8, 2, [1], [4], spatial_shape=(2, 2), process_group=group)


def _assert_placement(layout, offsets, w):
    """Every row on exactly one rank; each document whole on one rank, or cut only where no segment crosses (the
    rank's own sequences start there), or shared (its parts in the shared pack)."""
    ranges = sorted(rng for rows in layout.rows for rng in rows)
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]] and (ranges[0][0], ranges[-1][1]) == (
        0, offsets[-1]) if ranges else offsets[-1] == 0
    docs = [(a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    starts = [a for a, _ in docs]
    step = {}
    for j in range(layout.P):
        local, seqs = list(layout.rows[j]), layout.local_offsets[j]
        globals_ = []  # the global start of each local row range, row by row
        for a, b in local:
            globals_ += range(a, b)
        for s0, s1 in zip(seqs, seqs[1:]):
            a = globals_[s0]
            doc = docs[[i for i, x in enumerate(starts) if x <= a][-1]]
            assert globals_[s1 - 1] - a == s1 - s0 - 1 and globals_[s1 - 1] < doc[1]  # one range of one document
            if (a, globals_[s1 - 1] + 1) != doc:  # a piece: starts and ends where no segment crosses
                n = doc[1] - doc[0]
                cut = math.lcm(*(min(x, n) for x in w)) if w else n
                assert (a - doc[0]) % cut == 0 and (globals_[s1 - 1] + 1 == doc[1] or (s1 - s0) % cut == 0)
                step[doc] = cut
    return step


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_place_documents(P):
    """Placement: rows placed once, documents whole or cut where no segment crosses, the named cases' features,
    the same layout every time, and the 16-document benchmark pack balanced within 2% of the mean work."""
    for case in _document_cases(max(P, 2)):
        offsets = list(itertools.accumulate([0, *case["lengths"]]))
        layout = dilated_attn.place_documents(offsets, case.get("w"), case.get("r"), causal=case.get("causal", False),
                                              num_ranks=P)
        again = dilated_attn.place_documents(torch.tensor(offsets), case.get("w"), case.get("r"),
                                             causal=case.get("causal", False), num_ranks=P)
        assert again.digest == layout.digest and repr(again) == repr(layout)
        _assert_placement(layout, offsets, case.get("w"))
        if P == 1:
            assert layout.cut == layout.shared == 0 and layout.rows == (((0, offsets[-1]),),)
        elif P <= 4:  # what the case's name says it holds on the worlds the gloo test runs it on
            name = case["name"]
            if name.startswith(("documents whole", "documents cut", "dense", "segments", "split")):
                assert (layout.shared > 0) == ("shared" in name), (name, layout)
                assert (layout.cut > 0) == ("cut" in name), (name, layout)
            if "fewer rows" in name:
                assert any(layout.length(j) == 0 for j in range(P)), (name, layout)
    lengths = [1024, 16384, 2048, 12288, 4096, 9216, 15360, 3072, 6144, 11264, 8192, 13312, 5120, 7168, 10240, 6144]
    offsets = list(itertools.accumulate([0, *lengths]))
    layout = dilated_attn.place_documents(offsets, [2048, 4096, 8192, 16384], [1, 2, 4, 8], num_ranks=P)
    if P <= 4:
        assert layout.cut == layout.shared == 0 and max(layout.work) <= 1.02 * sum(layout.work) / P, layout
    else:  # the longest document is more than a share: a ring of two ranks runs it (its segments span it)
        assert layout.shared == 16384 and max(layout.work) <= 1.1 * sum(layout.work) / P, layout
    assert sum(map(dilated_attn.ring.documents.document_work, lengths, [[2048, 4096, 8192, 16384]] * 16,
                   [[1, 2, 4, 8]] * 16, [False] * 16)) == pytest.approx(sum(layout.work))


@pytest.mark.parametrize("args, kwargs, error, match", [
    (([0, 5, 3],), {}, ValueError, "non-decreasing"),
    (([1, 5],), {}, ValueError, "cu_seqlens\\[0\\] must be 0"),
    ((torch.tensor([0.0, 5.0]),), {}, ValueError, "int32 or int64"),
    (("0,5",), {}, TypeError, "cu_seqlens"),
    (([0, 5], [4]), {}, ValueError, "both be None"),
    (([0, 5], [4], [0]), {}, ValueError, "dilation_rates\\[0\\] must be a positive integer"),
    (([0, 5],), dict(num_ranks=0), ValueError, "num_ranks"),
    (([0, 5],), dict(causal=1), TypeError, "causal"),
])
def test_place_documents_refuses(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        dilated_attn.place_documents(*args, **kwargs)


def test_documents_layout_one_process():
    """One process: ring_attention under a DocumentLayout is dilated_attention_varlen; shard and unshard are the
    identity; calls that do not fit the layout raise, naming the rule."""
    lengths = [5, 0, 9, 3]
    cu = torch.tensor(list(itertools.accumulate([0, *lengths])))
    q, k, v = (torch.randn(17, 4, 3, dtype=torch.float64) for _ in range(3))
    layout = dilated_attn.place_documents(cu, [4], [2], causal=True)
    got = dilated_attn.ring_attention(*(dilated_attn.shard(x, layout=layout) for x in (q, k, v)), [4], [2],
                                      causal=True, layout=layout)
    want = dilated_attn.dilated_attention_varlen(q, k, v, cu, [4], [2], causal=True)
    assert torch.equal(dilated_attn.unshard(got, layout=layout), want)
    assert dilated_attn.explain_ring(q, k, v, [4], [2], causal=True, layout=layout).mode == "ring"
    for kwargs, match in [
        (dict(mode="heads"), "mode must be 'auto' or 'ring'"),
        (dict(cu_seqlens=cu), "pass cu_seqlens=None"),
        (dict(w=[8]), "placed for the branches"),
        (dict(x=q[:16]), "holds 17 rows of the DocumentLayout, got 16"),
        (dict(layout=dilated_attn.place_documents(cu, [4], [2], num_ranks=2)), "placed for 2 ranks"),
    ]:
        x, w = kwargs.pop("x", q), kwargs.pop("w", [4])
        with pytest.raises(ValueError, match=match):
            dilated_attn.ring_attention(x, x, x, w, [2], **{"layout": layout, **kwargs})
    with pytest.raises(ValueError, match="dim 0 must be the layout's 17"):
        dilated_attn.shard(q[:, :3].transpose(0, 1), layout=layout)


def test_a_pack_cut_along_its_heads_is_told_to_shard_its_rows():
    """A pack whose ranks hold its heads instead of its rows (shard without dim=0) is refused naming the whole pack's
    rows as P * L and the way to shard it."""
    from dilated_attn.ring.layout import Groups
    from dilated_attn.ring.modes import plan_call

    pack = torch.randn(512, 2, 4)  # this rank's half of 4 heads, all 512 rows
    with pytest.raises(ValueError, match=r"the whole pack's P \* L = 2 \* 512 = 1024 rows .*shard\(x, dim=0\)"):
        plan_call(pack, pack, pack, [64], [1], causal=False, scale=None, head_groups="all", layout="contiguous",
                  return_lse=False, backend="auto", mode="auto", groups=Groups((None,), (0,), (2,), 2, 0),
                  cu_seqlens=torch.tensor([0, 200, 512]))


def test_ranks_that_differ_are_named_plainly():
    """The check's message where two ranks' descriptors differ: the field, the rank that differs from rank 0, and the
    values where they mean something (a digest of packs or a scale's bits do not)."""
    from dilated_attn.ring import check

    fields = list(range(len(check._FIELDS)))
    rows = []
    for digest in (7, 8):
        fields[check._FIELDS.index("segment_lengths/dilation_rates/cu_seqlens")] = digest
        rows.append(check._HEADER.pack(0, 0, *fields, 0) + bytes(check._MESSAGE_BYTES))
    table = torch.stack([torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in rows])
    error = check._read_config(table)
    assert str(error) == ("ring_attention: every rank of the group must pass the same "
                          "segment_lengths/dilation_rates/cu_seqlens, but rank 1 of the group passes another than "
                          "its rank 0")


@pytest.mark.parametrize("P, Hkv, mode", [(2, 4, "ring"), (2, 1, "ring"), (4, 4, "heads")])
def test_auto_takes_the_mode_that_sends_fewer_bytes_and_the_ring_on_a_tie(P, Hkv, mode):
    """Dense causal zigzag shards: at P = 2 with as many kv heads as query heads the all-to-all sends what the ring
    sends (each rank's K/V once), and auto keeps the ring; with one kv head the ring sends less, at P = 4 (4 heads)
    the all-to-all."""
    from dilated_attn.ring.layout import Groups
    from dilated_attn.ring.modes import plan_call

    q = torch.randn(1, 64, 4, 8)
    kv = torch.randn(1, 64, Hkv, 8)
    call = plan_call(q, kv, kv, None, None, causal=True, scale=None, head_groups="all", layout="zigzag",
                     return_lse=False, backend="auto", mode="auto", groups=Groups((None,), (0,), (P,), P, 0))
    sent = call.bytes_per_rank
    assert call.mode == mode
    if mode == "ring":
        assert sent["ring"] <= sent["heads"] and call.reason == "it sends no more bytes than heads"
        assert (sent["ring"] == sent["heads"]) == (Hkv == 4)
    else:
        assert sent["heads"] < sent["ring"] and call.reason == "it sends fewer bytes than ring"
