"""Decoding with a KV cache on the GPU: one new token per sequence against the bytes it must read.

    python benchmarks/bench_decode.py                  # B=16, Hq=16, Hkv=4, D=128, 64K tokens in all, bf16
    python benchmarks/bench_decode.py --cached 16384 --sq 4

Rows:
  decode     dilated_attn.dilated_attention_with_kvcache (--backend, default auto: triton's decode kernel; each
             backend's is one launch that writes the new k, v into the cache and attends over every branch), the whole
             call as a user makes it in eager mode (validation and dispatch included), cache_seqlens an int; the host's
             time is hidden where the flush before it runs longer on the GPU
  back to back   BACK_TO_BACK such eager calls issued one after another, started with the GPU idle (L2 flushed and
             the host waiting for it, else the flush's GPU time would hide as much host time), the time per call: the
             host's time per call where it takes longer to issue one than the GPU to run it, as in a decoding loop in
             eager mode
  graphed    the same whole call with cache_seqlens a GPU tensor (no device-to-host copy), captured in a CUDA graph
             and replayed, as a decoding loop runs it: the GPU's time
  back to back, cuda / graphed, cuda   the same two rows with backend="cuda" (the CUDA decode kernel)
  kernel, cuda   the CUDA decode kernel alone without the write (backends/decoding.cuda_decode), captured in a CUDA
             graph and replayed (with --sweep, first each pipeline depth: the fastest is kept)
  kernel, triton the Triton decode kernel alone (backends/triton/ops.decode), likewise
  kernel, L2 dirty   --backend's kernel after L2 was filled with written lines (256 MiB zeroed), whose write-back it
             pays
  recompute  dilated_attention over the whole prefix, causal, for the new token's row (what a model without a
             cache path does; run once per batch element's prefix as one batch)
The yardstick: the bytes of cached K and V the new tokens attend to (the union of their member rows over the
branches and the query heads of each kv head, read once) over the device's copy bandwidth, measured here as
bytes read + written per second by a 1 GiB device-to-device copy. Times are medians of --repeats runs after
--warmup (dilated_attn.cli.measure.median_ms, L2 flushed before each run).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton

import dilated_attn
from dilated_attn.branches import branch_table
from dilated_attn.cli.measure import L2_FLUSH_BYTES, LONGNET, Record, median_ms, say


def attended_rows(position: int, segs, dils, heads: int, kv_heads: int, head_groups: str) -> list[int]:
    """Per kv head, how many distinct cache rows the query heads of that kv head read for a token at `position`."""
    table = branch_table(segs, dils, max(segs), heads, head_groups)
    group = heads // kv_heads
    counts = []
    for kvh in range(kv_heads):
        rows = set()
        for h in range(kvh * group, (kvh + 1) * group):
            for br in table:
                if not br.head_lo <= h < br.head_hi:
                    continue
                start = position // br.seg_len * br.seg_len
                offset = br.offset(h)
                if (position - start) % br.dilation == offset:
                    rows.update(range(start + offset, position + 1, br.dilation))
        counts.append(len(rows))
    return counts


def copy_bandwidth(warmup: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), "cuda", warmup, repeats)
    return 2 * src.numel() / (ms / 1e3)


# The kernel configurations --sweep times: every combination. A register cap (maxnreg) lets more programs share an
# SM than the compiler's own choice, at the price of some spilled registers.
SWEEP = dict(programs=(256, 384, 512, 1024), BLOCK_N=(32, 64), num_warps=(2, 4), num_stages=(2, 3),
             maxnreg=(None, 128, 168))


def sweep_space(overrides: list[str]) -> dict:
    """SWEEP with the values given as NAME=V1,V2 (integers, or 'none')."""
    space = dict(SWEEP)
    for item in overrides:
        name, _, values = item.partition("=")
        if name not in SWEEP or not values:
            raise SystemExit(f"--sweep-values: expected NAME=V1,V2 with NAME one of {', '.join(SWEEP)}, got {item!r}")
        try:
            space[name] = tuple(None if v.strip().lower() == "none" else int(v) for v in values.split(","))
        except ValueError:
            raise SystemExit(f"--sweep-values: {name}'s values must be integers or 'none', got {values!r}") from None
    return space


BACK_TO_BACK = 50  # eager calls per timed run of the "back to back" row (the last one's GPU time is not hidden)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--cached", type=int, default=65535,
                    help="tokens already in the cache (default 65535: the new token, the 65536th, ends a segment of "
                         "every branch and attends to the most keys)")
    ap.add_argument("--sq", type=int, default=1, help="new tokens per call")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--backend", default="auto", help="the backend of the whole-call rows (default auto)")
    ap.add_argument("--sweep", action="store_true",
                    help="first time the Triton kernel (CUDA graph) for each count of programs, block of keys, warp "
                         "count, pipeline depth and register cap (SWEEP), and the CUDA kernel for each pipeline depth, "
                         "and keep the best of each")
    ap.add_argument("--sweep-values", action="append", default=[], metavar="NAME=V1,V2",
                    help="with --sweep, the values of one of SWEEP's names instead of its own ('none' for no register "
                         "cap), e.g. --sweep-values programs=384,512; repeatable")
    ap.add_argument("--host-profile", action="store_true",
                    help="then where the eager call's host time goes: each part's host time per call (into the JSON's "
                         "host_parts_us) and cProfile's top functions over --repeats calls")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/decode_<device>.json)")
    args = ap.parse_args(argv)
    B, H, Hkv, D, Sq, cached = args.batch, args.heads, args.kv_heads, args.dim, args.sq, args.cached
    dtype = getattr(torch, args.dtype)
    dev = torch.cuda.get_device_name()
    say(f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}")
    segs, dils = LONGNET
    bandwidth = copy_bandwidth(args.warmup, args.repeats)
    say(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
    g = torch.Generator(device="cuda").manual_seed(0)
    Nmax = cached + Sq
    k_cache = torch.randn(B, Nmax, Hkv, D, generator=g, device="cuda", dtype=dtype)
    v_cache = torch.randn(B, Nmax, Hkv, D, generator=g, device="cuda", dtype=dtype)
    q = torch.randn(B, Sq, H, D, generator=g, device="cuda", dtype=dtype)
    k_new = k_cache[:, cached:].clone()
    v_new = v_cache[:, cached:].clone()
    rows = sum(sum(attended_rows(cached + i, segs, dils, H, Hkv, "all")) for i in range(Sq))
    attended = B * rows * 2 * D * k_cache.element_size()  # K and V rows; a row read once for its kv head's heads
    ideal_ms = attended / bandwidth * 1e3
    say(f"attended K/V: {attended / 2**20:.1f} MiB per call -> {ideal_ms * 1e3:.1f} us at the copy bandwidth")

    def decode(lengths=cached, backend=args.backend):
        dilated_attn.dilated_attention_with_kvcache(q, k_cache, v_cache, lengths, segs, dils, k=k_new, v=v_new,
                                                    backend=backend)

    from dilated_attn import dispatch
    from dilated_attn.backends import decoding
    from dilated_attn.backends.triton import ops
    from dilated_attn.cache_spec import validate_kvcache

    cp = validate_kvcache(q, k_cache, v_cache, cached, segs, dils)
    chosen = dispatch.select(cp.problem, args.backend).name
    say(f"backend {args.backend}: {chosen}")

    def graph_of(call):
        call()  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        return graph

    def captured():
        return graph_of(lambda: ops.decode(q, k_cache, v_cache, None, None, cp))

    def cuda_kernel():
        return graph_of(lambda: decoding.cuda_decode(q, k_cache, v_cache, None, None, cp))

    sweep, choices = {}, {}
    if args.sweep:
        space = sweep_space(args.sweep_values)
        for values in itertools.product(*space.values()):
            config = dict(zip(space, values))
            ops.DECODE_PROGRAMS = config.pop("programs")
            ops.DECODE_CONFIG = config
            name = ", ".join(f"{key}={value}" for key, value in zip(space, values))
            try:
                graph = captured()
            except triton.runtime.errors.OutOfResources as exc:
                say(f"  kernel, {name}: skipped ({exc})")
                continue
            sweep[name] = median_ms(graph.replay, "cuda", args.warmup, args.repeats)
            choices[name] = (ops.DECODE_PROGRAMS, dict(ops.DECODE_CONFIG))
            say(f"  kernel, {name}: {sweep[name] * 1e3:8.1f} us")
        ops.DECODE_PROGRAMS, ops.DECODE_CONFIG = choices[min(sweep, key=sweep.get)]
        cuda_sweep = {}
        for stages in (2, 3, 4):
            decoding.CUDA_DECODE_STAGES = stages
            cuda_sweep[stages] = median_ms(cuda_kernel().replay, "cuda", args.warmup, args.repeats)
            sweep[f"cuda, stages={stages}"] = cuda_sweep[stages]
            say(f"  CUDA kernel, stages={stages}: {cuda_sweep[stages] * 1e3:8.1f} us")
        decoding.CUDA_DECODE_STAGES = min(cuda_sweep, key=cuda_sweep.get)
    triton_graph, cuda_graph = captured(), cuda_kernel()

    def back_to_back(backend=args.backend):
        for _ in range(BACK_TO_BACK):
            decode(backend=backend)

    lengths = torch.full((B,), cached, dtype=torch.int32, device="cuda")
    decode_graph = graph_of(lambda: decode(lengths))
    decode_graph_cuda = graph_of(lambda: decode(lengths, "cuda"))

    q_full = torch.randn(B, Nmax, H, D, generator=g, device="cuda", dtype=dtype)

    def recompute():
        dilated_attn.dilated_attention(q_full, k_cache, v_cache, segs, dils, causal=True, backend="triton")

    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"decode_{dev.replace(' ', '_')}.json")
    record = Record("kvcache_decode", "cuda", dict(batch=B, heads=H, kv_heads=Hkv, head_dim=D, cached=cached, sq=Sq,
                                                   dtype=args.dtype, segment_lengths=segs, dilation_rates=dils,
                                                   warmup=args.warmup, repeats=args.repeats),
                    json_path=out, copy_bandwidth_gbs=bandwidth / 1e9, attended_bytes=attended,
                    ideal_us=ideal_ms * 1e3, backend=chosen, cuda_kernel_stages=decoding.CUDA_DECODE_STAGES,
                    kernel_config=dict(ops.DECODE_CONFIG, programs=ops.DECODE_PROGRAMS),
                    kernel_sweep_us={k: v * 1e3 for k, v in sweep.items()})
    # The kernel after L2 was filled with written lines (as a zeroing flush leaves it, or a kernel that wrote more than
    # L2 holds): their write-back falls on it (median_ms's own flush reads, leaving L2 clean)
    written = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    with torch.no_grad():
        times = {}
        for name, fn, repeats, before in (
                ("decode", decode, args.repeats, None),
                ("back to back", back_to_back, args.repeats, torch.cuda.synchronize),
                ("graphed", decode_graph.replay, args.repeats, None),
                ("back to back, cuda", lambda: back_to_back("cuda"), args.repeats, torch.cuda.synchronize),
                ("graphed, cuda", decode_graph_cuda.replay, args.repeats, None),
                ("kernel, cuda", cuda_graph.replay, args.repeats, None),
                ("kernel, triton", triton_graph.replay, args.repeats, None),
                ("kernel, L2 dirty", (cuda_graph if chosen == "cuda" else triton_graph).replay, args.repeats,
                 written.zero_),
                ("recompute", recompute, max(3, args.repeats // 20), None)):
            times[name] = median_ms(fn, "cuda", args.warmup if name != "recompute" else 2, repeats, before_run=before)
            if name.startswith("back to back"):
                times[name] /= BACK_TO_BACK
            record.add(dict(provider=name, median_us=times[name] * 1e3, over_ideal=times[name] / ideal_ms))
            say(f"{name:>16}: {times[name] * 1e3:10.1f} us  ({times[name] / ideal_ms:.2f}x the copy-bandwidth time)")
    say(f"decode is {times['recompute'] / times['decode']:.0f}x faster than recomputing the prefix")
    record.set(speedup_over_recompute=times["recompute"] / times["decode"])
    record.close()
    if args.host_profile:
        backend = dispatch.select(cp.problem, args.backend)
        cp_new = validate_kvcache(q, k_cache, v_cache, cached, segs, dils, k=k_new, v=v_new, backend=args.backend)
        parts = {
            "whole call": decode,
            "validate_kvcache": lambda: validate_kvcache(q, k_cache, v_cache, cached, segs, dils, k=k_new, v=v_new,
                                                         backend=args.backend),
            "dispatch.select": lambda: dispatch.select(cp.problem, args.backend),
            "forward_kvcache (one launch)": lambda: backend.forward_kvcache(q, k_cache, v_cache, k_new, v_new, cp_new),
            "the output's allocation": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        }
        record.set(host_parts_us=host_profile(parts, args.repeats))


HOST_ROUNDS = 5


def host_profile(parts: dict, repeats: int) -> dict:
    """The host's time per call of each part (issued without waiting for the GPU; "whole call" first): the least of
    HOST_ROUNDS rounds of `repeats` calls (other work on the host only adds to a round), then cProfile's top functions
    over the whole call. Returns {part: us}."""
    import cProfile
    import pstats
    import time

    times = {}
    with torch.no_grad():
        for name, call in parts.items():
            for _ in range(10):
                call()
            rounds = []
            for _ in range(HOST_ROUNDS):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(repeats):
                    call()
                rounds.append((time.perf_counter() - start) / repeats * 1e6)
            times[name] = min(rounds)
            torch.cuda.synchronize()
            say(f"host, {name}: {times[name]:.1f} us per call to issue")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            parts["whole call"]()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(30)
    return times


if __name__ == "__main__":
    main()
