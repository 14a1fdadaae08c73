"""The Triton backend against the reference: on the GPU (marker `gpu`), and without one through Triton's
interpreter on CPU tensors (small sizes, float32/float16: the interpreter computes bfloat16 wrongly)."""

import functools
import random

import pytest
import torch
from cases import random_case
from parity import (
    GPU_CASES,
    assert_bitwise_repeatable,
    assert_forward_allocates_only_out_and_lse,
    check_against_reference,
    poison_allocator,
)

import dilated_attn

triton = pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run where there is no GPU")


@interpreter
@pytest.mark.parametrize("index", range(10))
def test_interpreter_parity_float32(index):
    case = random_case(random.Random(5000 + index), max_seq=40)
    check_against_reference(case, torch.float32, "cpu", index, "triton")


@interpreter
@pytest.mark.parametrize("index", range(3))
def test_interpreter_parity_float16(index):
    case = random_case(random.Random(6000 + index), max_seq=32)
    check_against_reference(case, torch.float16, "cpu", index, "triton")


@interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_long_segments_cross_block_borders(causal):
    """More members than one block (16 under the interpreter): mask-free inner blocks, masked diagonal and
    partial blocks; GQA with differing head offsets (the two query heads of the kv head, in the dilated branch)."""
    from cases import Case

    case = Case(1, 70, 2, 1, 8, (70, 35), (1, 2), "all", causal, "contiguous")
    check_against_reference(case, torch.float32, "cpu", 0, "triton")


def record_launch_configs(monkeypatch) -> dict:
    """{kernel: {(BLOCK_M, BLOCK_N) of each launch}} of the Triton launches made from now on."""
    from dilated_attn.backends.triton import configs

    seen = {}
    real = configs.wrap_triton

    def spy(kernel):
        launcher = real(kernel)

        class Recording:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    seen.setdefault(kernel, set()).add((kwargs.get("BLOCK_M"), kwargs.get("BLOCK_N")))
                    return launcher[grid](*args, **kwargs)
                return run

        return Recording()

    monkeypatch.setattr(configs, "wrap_triton", spy)
    return seen


def force_configs(monkeypatch, index: int, every: bool = True) -> dict:
    """Force each tunable kernel's index-th candidate (modulo their number; `every`: the tf32x3-only ones too,
    else only those); returns {kernel function: (BLOCK_M, BLOCK_N)}."""
    from dilated_attn.backends.triton import configs, ops

    chosen = {}
    for t in ops.TUNABLES:
        candidates = t.candidates + t.tf32x3_candidates if every else t.tf32x3_candidates
        config = candidates[index % len(candidates)]
        monkeypatch.setitem(configs.FORCED, t.name, config)
        chosen[t.fn] = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])
    return chosen


@interpreter
@pytest.mark.parametrize("index", range(11))
def test_interpreter_every_config_block_shape(index, monkeypatch):
    """The block shapes of every candidate config (the tf32x3-only ones included), each kernel running its
    index-th: the masks of partial, diagonal and mask-free blocks hold for each shape. Under the interpreter
    (which ignores num_warps, num_stages and the products' precision) this runs where there is no GPU. Two query
    heads on one kv head, of different offsets in the dilated branches: every program's blocks are those of four
    heads on two kv heads, in half the interpreter's time."""
    from cases import Case

    from dilated_attn.backends.triton import ops

    assert max(len(t.candidates + t.tf32x3_candidates) for t in ops.TUNABLES) == 11
    chosen = force_configs(monkeypatch, index)
    seen = record_launch_configs(monkeypatch)
    case = Case(1, 150, 2, 1, 24, (150, 75, 40), (1, 2, 3), "all", index % 2 == 1, "transposed")
    check_against_reference(case, torch.float32, "cpu", index, "triton")
    for fn, shape in chosen.items():
        assert seen[fn] == {shape}


def test_auto_tile_order_rule():
    from dilated_attn.backends.triton.ops import TILE_ORDER, auto_tile_order

    assert TILE_ORDER == "auto" or "DILATED_ATTN_TILE_ORDER" in __import__("os").environ
    assert auto_tile_order(16384, 16, 16) == auto_tile_order(65536, 16, 16) == "plain"
    assert auto_tile_order(65536, 16, 2) == auto_tile_order(262144, 16, 16) == "hilbert"


@functools.lru_cache(maxsize=None)
def _with_tile_order(order: str):
    """(out, lse) of one causal call with TILE_ORDER = order, on the same inputs for every order (the plain
    order's result, which each order is compared with, is computed once)."""
    from dilated_attn.backends.triton import ops as triton_ops

    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 45, h, 8, device=device, generator=g) for h in (6, 3, 3))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(triton_ops, "TILE_ORDER", order)
        return dilated_attn.dilated_attention(q, k, v, [8, 16, 45], [1, 2, 3], causal=True, return_lse=True,
                                              backend="triton")


@pytest.mark.parametrize("order", ["segment", "hilbert"])
def test_tile_orders_give_the_same_result(order):
    """Every tile order visits every (batch, head, segment) tile exactly once: results equal the plain
    order's bit for bit (each tile's arithmetic is the same, only the launch order changes)."""
    from dilated_attn.backends.triton import ops as triton_ops

    device = "cuda" if HAS_CUDA else "cpu"
    table = triton_ops.tile_order(order, 2, 6, 3, torch.device(device)).cpu()
    assert sorted(table.tolist()) == list(range(36)) and table.tolist() != list(range(36))
    for a, b in zip(_with_tile_order(order), _with_tile_order("plain")):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_gpu_parity(index, dtype):
    check_against_reference(GPU_CASES[index], dtype, "cuda", index, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(head_dim, causal):
    from cases import Case

    case = Case(2, 777, 6, 2, head_dim, (256, 512, 1024), (1, 2, 4), "all", causal, "contiguous")
    check_against_reference(case, torch.bfloat16, "cuda", head_dim, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("head_dim, causal, layout", [(128, False, "transposed"), (72, True, "contiguous")])
def test_gpu_tf32x3_configs(index, head_dim, causal, layout, monkeypatch):
    """The candidates only for tf32x3 products (float32 on Ampere and newer, head dim <= 128), each forced in
    turn: whether or not the shipped table picks them on this GPU, each must be exact."""
    from cases import Case

    from dilated_attn.backends.triton import float32_precision, ops

    if float32_precision(torch.device("cuda"), head_dim) != "tf32x3":
        pytest.skip("tf32x3 products need Ampere or newer, TF32 not allowed and tiles that fit")
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    for t in ops.TUNABLES:
        config = t.tf32x3_candidates[index % len(t.tf32x3_candidates)]
        if t.shared_memory(config, 128, 4, "tf32x3") > limit:
            pytest.skip(f"{config} does not fit in this GPU's {limit} bytes of shared memory per block")
    chosen = force_configs(monkeypatch, index, every=False)
    seen = record_launch_configs(monkeypatch)
    case = Case(2, 777, 6, 2, head_dim, (256, 512, 1024), (1, 2, 4), "all", causal, layout)
    check_against_reference(case, torch.float32, "cuda", index, "triton")
    for fn, shape in chosen.items():
        assert seen[fn] == {shape}


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(0, len(GPU_CASES), 6))
def test_gpu_poisoned_memory(index):
    poison_allocator()
    check_against_reference(GPU_CASES[index], torch.bfloat16, "cuda", index, "triton")


@pytest.mark.gpu
def test_gpu_forward_allocates_only_out_and_lse():
    assert_forward_allocates_only_out_and_lse("triton")


@pytest.mark.gpu
def test_gpu_backward_allocates_only_gradients_and_row_scratch():
    """Measured as users run it: autograd's backward of the Triton op, after the forward."""
    B, N, H, Hkv, D = 1, 16384, 8, 2, 128
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad_out = torch.randn_like(q)
    args = ([2048, 4096, 8192], [1, 2, 4])
    for measured in (False, True):  # the first round compiles the kernels
        out = dilated_attn.dilated_attention(q, k, v, *args, backend="triton")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        del out
    gradients = sum(g.numel() * g.element_size() for g in grads)
    row_scratch = B * H * N * 4  # delta, fp32, one value per (batch, head, position)
    assert extra <= gradients + row_scratch + (1 << 20), f"extra {extra}, gradients {gradients}, scratch {row_scratch}"


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    q, k, v = (torch.randn(2, 500, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return dilated_attn.dilated_attention(q, k, v, [128, 256], [1, 2], causal=True, backend="triton")

    compiled = torch.compile(f, fullgraph=True)
    eager = f(q, k, v)
    out = compiled(q, k, v)
    # Under torch.compile the scale reaches the kernel as a float64 scalar, so a few scores round
    # differently: allow one bf16 ulp.
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=2e-3)
    (g_eager,) = torch.autograd.grad(eager.float().square().sum(), (q,))
    (g_comp,) = torch.autograd.grad(out.float().square().sum(), (q,))
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_auto_picks_triton():
    from dilated_attn import dispatch
    from dilated_attn.spec import validate

    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    kv = q[:, :, :1]  # GQA, which the cudnn backend (auto's first choice on Hopper) does not take
    assert dispatch.select(validate(q, kv, kv, [32], [1]), "auto").name == "triton"


@pytest.mark.gpu
def test_gpu_bitwise_repeatable():
    """No atomics (positions written by two programs of one launch never coincide): the same inputs give the
    same bits, forward and backward, once the autotuner has settled."""
    assert_bitwise_repeatable("triton", calls=3)


FIRST_CALL_FROM_TWO_THREADS = r"""
import builtins, threading, time
import torch
import dilated_attn

real_import = builtins.__import__

def slow_ops_import(name, globals=None, locals=None, fromlist=(), level=0):
    # the backend's `from . import ops` takes a second, so that the other thread calls while it is in flight
    if level == 1 and fromlist and "ops" in fromlist and (globals or {}).get("__name__") == \
            "dilated_attn.backends.triton":
        time.sleep(1.0)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = slow_ops_import
errors = []

def first_call():  # what a call does before its kernels: the backend's ops, loaded on first use
    try:
        dilated_attn.backends.TRITON.ops()
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=first_call) for _ in range(2)]
for t in threads:
    t.start()
    time.sleep(0.3)
for t in threads:
    t.join()
assert not errors, errors
# and the kernels run (here: one thread; Triton's CPU interpreter is not thread-safe itself)
device = "cuda" if torch.cuda.is_available() else "cpu"
q = torch.randn(1, 8, 2, 16, device=device)
dilated_attn.dilated_attention(q, q, q, [4], [1], backend="triton")
"""


def test_first_call_from_two_threads(tmp_path):
    """Two threads making the process's first triton call at once (a data-loader thread, a server's worker pool):
    the second waits until the ops are registered instead of finding them missing."""
    import subprocess
    import sys

    script = tmp_path / "two_threads.py"
    script.write_text(FIRST_CALL_FROM_TWO_THREADS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
