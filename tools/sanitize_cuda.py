"""A small forward + backward of the CUDA kernels on odd shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  --error-exitcode 1 python tools/sanitize_cuda.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_cuda.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python tools/sanitize_cuda.py

Covers every dtype, a padded head dim (40) and exact ones (64, 96, 128, 256), GQA, both head groupings, causal and not,
partial last segments, w > N, and non-contiguous inputs.
"""

import torch

import dilated_attn


def main():
    torch.manual_seed(0)
    configs = [  # (B, N, Hq, Hkv, D, segment_lengths, dilation_rates, head_groups, causal)
        (1, 131, 4, 2, 40, [64, 200], [1, 3], "all", True),
        (2, 97, 3, 1, 64, [32, 50, 97], [2, 1, 4], "split", False),
        (1, 70, 6, 3, 40, [16, 40], [4, 2], "all", False),
        (1, 90, 2, 1, 128, [48, 90], [1, 2], "all", True),
        # dK/dV's output dims split over two blocks at 256
        (1, 45, 2, 1, 96, [16, 45], [1, 2], "split", False),
        (1, 40, 2, 2, 256, [40], [2], "all", True),
    ]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for B, N, Hq, Hkv, D, w, r, groups, causal in configs:
            q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            k = torch.randn(B, N, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(B, N, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
            out, lse = dilated_attn.dilated_attention(q, k, v, w, r, causal=causal, head_groups=groups,
                                                      return_lse=True, backend="cuda")
            loss = out.float().square().sum() + lse.masked_fill(lse.isinf(), 0).sum()
            grads = torch.autograd.grad(loss, (q, k, v))
            assert all(torch.isfinite(g).all() for g in grads)
    torch.cuda.synchronize()
    print("sanitize_cuda: forward + backward ran on", len(configs) * 3, "configurations")


if __name__ == "__main__":
    main()
