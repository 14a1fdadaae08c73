"""The hand-written CUDA kernels (backend="cuda") against the reference, on the GPU (marker `gpu`)."""

import pytest
import torch
from cases import Case
from parity import (
    GPU_CASES,
    assert_bitwise_repeatable,
    assert_forward_allocates_only_out_and_lse,
    check_against_reference,
    poison_allocator,
)

import dilated_attn
from dilated_attn.backends import extension

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    if torch.cuda.is_available() and not extension.has_kernel("cuda"):
        pytest.fail("a GPU is present but dilated_attn._C was built without CUDA kernels")


def _pascal_tiles_run_here() -> bool:
    return torch.cuda.get_device_capability()[0] < 7 or dilated_attn.build_info()["pascal_tiles_on_newer_gpus"]


# Each test runs with the device's own tile table and with Pascal's two (csrc/cuda/launch.h), which a newer GPU runs
# when DILATED_ATTN_CUDA_TILES=pascal or gp100 in a build with DILATED_ATTN_PASCAL_PROXY=1 (benchmarks/run_on_gpu.sh
# makes one): Pascal's kernels are tested here even though no Pascal GPU is at hand.
@pytest.fixture(autouse=True, params=["device-tiles", "pascal-tiles", "gp100-tiles"])
def tile_table(request, monkeypatch):
    if request.param != "device-tiles":
        if not _pascal_tiles_run_here():
            pytest.skip("this build holds Pascal's tiles only for Pascal GPUs (build with DILATED_ATTN_PASCAL_PROXY=1)")
        monkeypatch.setenv("DILATED_ATTN_CUDA_TILES", request.param.split("-")[0])
    else:
        monkeypatch.delenv("DILATED_ATTN_CUDA_TILES", raising=False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_parity(index, dtype):
    check_against_reference(GPU_CASES[index], dtype, "cuda", index, "cuda")


# 32, 64, 96, 128, 256 have their own kernels; the others run zero-padded in the next larger one.
@pytest.mark.parametrize("head_dim", [1, 8, 32, 40, 64, 72, 96, 100, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(head_dim, causal):
    case = Case(2, 777, 6, 2, head_dim, (256, 512, 1024), (1, 2, 4), "all", causal, "contiguous")
    check_against_reference(case, torch.bfloat16, "cuda", head_dim, "cuda")


@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks_per_segment(causal):
    """Segments with several query and key blocks (64 members each), GQA heads with differing offsets,
    a partial last segment, and split heads."""
    for split in ("all", "split"):
        case = Case(1, 1500, 4, 2, 64, (700, 1400), (1, 3), split, causal, "contiguous")
        check_against_reference(case, torch.float32, "cuda", 3, "cuda")


@pytest.mark.parametrize("index", range(0, len(GPU_CASES), 4))
def test_poisoned_memory(index):
    poison_allocator()
    check_against_reference(GPU_CASES[index], torch.bfloat16, "cuda", index, "cuda")


def test_forward_allocates_only_out_and_lse():
    assert_forward_allocates_only_out_and_lse("cuda")


def test_bitwise_repeatable():
    """No atomics: the same inputs give the same bits, forward and backward."""
    assert_bitwise_repeatable("cuda")


def test_opcheck():
    q = torch.randn(1, 100, 4, 32, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 100, 2, 32, device="cuda", requires_grad=True) for _ in range(2))
    args = (q, k, v, [32, 64], [1, 2], False, True, 0.2)
    torch.library.opcheck(torch.ops.dilated_attn.forward.default, args)
    q, k, v = q.detach(), k.detach(), v.detach()  # the backward op is not itself differentiable
    out, lse = torch.ops.dilated_attn.forward(q, k, v, *args[3:])
    torch.library.opcheck(torch.ops.dilated_attn.backward.default,
                          (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *args[3:]))


def test_bad_input_raises():
    q = torch.randn(1, 16, 2, 300, device="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        dilated_attn.dilated_attention(q, q, q, [8], [1], backend="cuda")
    q = torch.randn(1, 16, 2, 8, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        dilated_attn.dilated_attention(q, q, q, [8], [1], backend="cuda")


def test_tile_table_override_is_checked(monkeypatch):
    q = torch.randn(1, 16, 2, 8, device="cuda")
    monkeypatch.setenv("DILATED_ATTN_CUDA_TILES", "61")
    with pytest.raises(ValueError, match="DILATED_ATTN_CUDA_TILES must be 'pascal', 'gp100' or 'volta'"):
        dilated_attn.dilated_attention(q, q, q, [8], [1], backend="cuda")


def test_tile_table_missing_from_the_build_is_refused(monkeypatch):
    # Each architecture's code holds its own table: asking for the other one raises instead of launching nothing.
    q = torch.randn(1, 16, 2, 8, device="cuda")
    other = "volta" if torch.cuda.get_device_capability()[0] < 7 else "pascal"
    if other == "pascal" and _pascal_tiles_run_here():
        pytest.skip("this build holds Pascal's tiles for newer GPUs too (DILATED_ATTN_PASCAL_PROXY=1)")
    monkeypatch.setenv("DILATED_ATTN_CUDA_TILES", other)
    with pytest.raises(ValueError, match="holds no code of that tile table"):
        dilated_attn.dilated_attention(q, q, q, [8], [1], backend="cuda")
