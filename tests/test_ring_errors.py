"""ring_attention with invalid arguments on one rank only: every rank raises, within seconds, naming that rank.

A rank whose own arguments fail validation must not raise on its own, before the ranks' configuration check:
its peers would wait in that check's all-gather until the group's timeout (30 minutes by default). The workers
(spawned once per test, running every case in turn) write what each call raised, and how long it took, to files
the test reads.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dilated_attn
from test_ring import _free_port

# Short, so that a regression (a rank left waiting for its peers) fails the test instead of hanging CI.
PG_TIMEOUT_S = 30
# Every rank must have raised within this many seconds of its call.
RAISE_WITHIN_S = 10
# The longest the spawned world may run before the test kills it and fails.
WORLD_DEADLINE_S = 120

# Each case: the arguments of every rank ("args"), those that differ on the bad rank ("bad"), and what that rank
# breaks: the type it raises and a piece of the rule's message.
CASES = [
    dict(name="zigzag odd L", bad_rank=1, args=dict(layout="zigzag"), bad=dict(L=17), error="ValueError",
         rule="an even local length L, got L=17"),
    dict(name="dilation rate 0", bad_rank=0, args={}, bad=dict(r=0), error="ValueError",
         rule="dilation_rates[0] must be a positive integer, got 0"),
    dict(name="integer inputs", bad_rank=1, args={}, bad=dict(dtype="int64"), error="TypeError",
         rule="q must have a floating-point dtype, got torch.int64"),
    dict(name="unknown layout", bad_rank=0, args={}, bad=dict(layout="diagonal"), error="ValueError",
         rule="layout must be one of ('contiguous', 'zigzag'), got 'diagonal'"),
]


def _call(case, rank, device):
    """One ring_attention call with this rank's arguments; what it raised and how long it took."""
    a = dict(L=16, r=1, dtype="float32", layout="contiguous", device=device)
    a.update(case["args"])
    if rank == case["bad_rank"]:
        a.update(case["bad"])
    q = torch.ones(1, a["L"], 2, 4, dtype=getattr(torch, a["dtype"]), device=a["device"])
    start = time.monotonic()
    try:
        dilated_attn.ring_attention(q, q, q, [8], [a["r"]], layout=a["layout"])
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        return {"raised": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "traceback": traceback.format_exc()}
    return {"raised": None, "seconds": time.monotonic() - start}


def _valid_call(device):
    """A valid call after the failed ones: the group is still usable, the result still exact."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64).to(device) for _ in range(3))
    out = dilated_attn.ring_attention(*(dilated_attn.shard(x) for x in (q, k, v)), [4, 16], [1, 2], causal=True)
    want = dilated_attn.dilated_attention(q, k, v, [4, 16], [1, 2], causal=True, backend="reference")
    return (dilated_attn.unshard(out) - want).abs().max().item()


def _worker(rank, world, port, backend, cases, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    report = {"cases": [_call(case, rank, device) for case in cases]}
    try:
        report["valid call error"] = _valid_call(device)
    except Exception:  # noqa: BLE001
        report["valid call error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as in test_ring: skip the interpreter's teardown, where gloo's threads occasionally abort


def _spawn(backend, cases, tmp_path, world=2):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), backend, cases, str(tmp_path)), nprocs=world,
                             join=False)
    deadline = time.monotonic() + WORLD_DEADLINE_S
    while not ctx.join(timeout=0.2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the {world} ranks did not finish within {WORLD_DEADLINE_S} s (a hang)")
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


def _check(reports, cases):
    failures = []
    for rank, report in enumerate(reports):
        for case, res in zip(cases, report["cases"]):
            bad = case["bad_rank"]
            if rank == bad:
                want_type, prefix = case["error"], f"ring_attention: rank {bad}: "
            else:
                want_type, prefix = "ValueError", f"ring_attention: rank {bad}'s arguments are invalid: "
            message = res.get("message", "")
            if (res["raised"] != want_type or not message.startswith(prefix) or case["rule"] not in message
                    or not res["seconds"] < RAISE_WITHIN_S):
                failures.append(f"rank {rank}, {case['name']}: expected {want_type} {prefix!r}...{case['rule']!r} "
                                f"within {RAISE_WITHIN_S} s, got {res}")
        if not (isinstance(report["valid call error"], float) and report["valid call error"] < 1e-5):
            failures.append(f"rank {rank}, valid call after the errors: {report['valid call error']}")
    assert not failures, "\n".join(failures)


def test_bad_arguments_on_one_rank_raise_on_every_rank_gloo(tmp_path):
    _check(_spawn("gloo", CASES, tmp_path), CASES)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_bad_arguments_on_one_rank_raise_on_every_rank_nccl(tmp_path):
    # odd L under zigzag; and integer CPU inputs on one rank, where the gather must still use a CUDA tensor
    cases = [CASES[0], dict(CASES[2], bad=dict(dtype="int64", device="cpu"))]
    _check(_spawn("nccl", cases, tmp_path), cases)
