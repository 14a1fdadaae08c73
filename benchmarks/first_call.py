"""What the first call costs: the first forward+backward of `dilated_attention` in a new process, with empty kernel
caches (cold), with the caches the cold run filled (warm), and optionally after `dilated-attn warmup --backend fa4`
on empty caches (warmup); optionally `python -m dilated_attn` the same way.

    python benchmarks/first_call.py                               # the three families, cold and warm
    python benchmarks/first_call.py --after-warmup --out fc.json  # and after `warmup --backend fa4`
    python benchmarks/first_call.py --main --out first.json       # and the `dilated-attn` command

Each measurement runs in a fresh process whose caches (TRITON_CACHE_DIR, DILATED_ATTN_FA4_CACHE: FlashAttention-4's
compiled kernels and the fa4 backend's stored programs) are a new directory (cold) or the one its cold run filled
(warm). A process reports the seconds of `import dilated_attn`, of its first call (inputs ready to gradients
synchronised; the backend's import, planning and any compile included; torch's own first backward, which imports
sympy for any model, timed before it), whether it imported FlashAttention-4, how
many stored fa4 programs it loaded, how many Triton kernels it compiled (cache misses) and for how long, and how
many autotuning configs it benchmarked. The JSON names the device and the command.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

# (name, dtype, head dim, kv heads, causal): the families whose first call the README quotes
FAMILIES = {
    "bf16_d128": ("bfloat16", 128, 16, False),
    "bf16_d128_causal": ("bfloat16", 128, 16, True),
    "fp16_d64_gqa": ("float16", 64, 4, False),
}


def _seconds(times) -> float:
    """A Triton CompileTimes in seconds (its fields are microseconds)."""
    return times.total / 1e6


def child(family: str, seq_len: int, backend: str, profile: bool) -> None:
    """One first call, reported as a JSON line on stdout (with `profile`, after the first call's 30 costliest
    functions, by cumulative time)."""
    import torch
    import triton
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    began = time.perf_counter()
    import dilated_attn

    import_s = time.perf_counter() - began
    from dilated_attn.cli.measure import LONGNET, random_inputs

    dtype, head_dim, kv_heads, causal = FAMILIES[family]
    compiled = []
    benched = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            compiled.append((getattr(src, "name", "?"), _seconds(times)))

    previous = knobs.compilation.listener
    knobs.compilation.listener = listener
    original_bench = Autotuner._bench

    def counting_bench(self, *args, config, **meta):
        benched.append(str(config))
        return original_bench(self, *args, config=config, **meta)

    Autotuner._bench = counting_bench
    q, k, v, grad_out = random_inputs(1, seq_len, 16, head_dim, kv_heads=kv_heads, dtype=getattr(torch, dtype),
                                      device="cuda")
    segments, dilations = LONGNET
    torch.cuda.synchronize()
    # torch's own first backward (autograd imports torch.fx's symbolic shapes and sympy): any model's first step pays
    # it, in whichever layer runs first; timed apart from the attention's first call
    t0 = time.perf_counter()
    x = torch.ones(1, device="cuda", requires_grad=True)
    torch.autograd.grad(x * 2, x, torch.ones_like(x))
    torch.cuda.synchronize()
    torch_first_backward = time.perf_counter() - t0
    modules = set(sys.modules)
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    out = dilated_attn.dilated_attention(q, k, v, segments, dilations, causal=causal, backend=backend)
    torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    imported = sorted({name.split(".")[0] for name in set(sys.modules) - modules})
    t0 = time.perf_counter()
    out = dilated_attn.dilated_attention(q, k, v, segments, dilations, causal=causal, backend=backend)
    torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    knobs.compilation.listener = previous
    decision = dilated_attn.explain(q, k, v, segments, dilations, causal=causal, backend=backend)
    stored = 0
    if "dilated_attn.backends.fa4.direct" in sys.modules:
        from dilated_attn.backends.fa4 import direct

        stored = direct.FORWARD.loaded + direct.BACKWARD.loaded
    print(json.dumps(dict(import_s=import_s, torch_first_backward_s=torch_first_backward, first_call_s=first, second_call_s=second, backend=decision.backend,
                          flash_attn_imported="flash_attn.cute" in sys.modules, stored_programs_loaded=stored,
                          packages_imported_by_first_call=imported,
                          compiled=len(compiled), compile_s=sum(t for _, t in compiled),
                          compiled_kernels=sorted({name for name, _ in compiled}),
                          benchmarked_configs=len(benched), triton=triton.__version__)), flush=True)


def warmup_command(family: str, seq_len: int) -> list[str]:
    """`dilated-attn warmup --backend fa4` at the child's shapes."""
    from dilated_attn.cli.measure import LONGNET

    dtype, head_dim, kv_heads, causal = FAMILIES[family]
    segments, dilations = LONGNET
    return [sys.executable, "-m", "dilated_attn", "warmup", "--backend", "fa4", "--seq-len", str(seq_len),
            "--heads", "16", "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", dtype,
            "--causal", "true" if causal else "false", "--segment-lengths", *map(str, segments),
            "--dilation-rates", *map(str, dilations)]


def run(argv: list[str], cache: str, log=None) -> tuple[float, str]:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"), DILATED_ATTN_FA4_CACHE=os.path.join(cache, "fa4"))
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", None)  # FlashAttention-4's kernels too in the fa4 cache
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if log is not None:
        log.write(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--backend", default="auto", help="the backend of the calls (default: auto)")
    parser.add_argument("--profile", action="store_true",
                        help="each process prints its first call's costliest functions (cProfile) to stderr")
    parser.add_argument("--after-warmup", action="store_true",
                        help="also a first call after `dilated-attn warmup --backend fa4` on empty caches")
    parser.add_argument("--main", action="store_true", help="also time `python -m dilated_attn`, cold and warm")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    parser.add_argument("--log", default=None, help="where the `python -m dilated_attn` output goes")
    parser.add_argument("--child", choices=list(FAMILIES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seq_len, args.backend, args.profile)
        return

    import torch

    from dilated_attn.cli.measure import command_line, device_info, say, versions

    rows = []
    for family in args.families:
        states = ["cold", "warm"] + (["warmup"] if args.after_warmup else [])
        caches = {}
        for state in states:
            if state != "warm":
                caches[state] = tempfile.mkdtemp(prefix="first_call_")
            cache = caches["cold" if state == "warm" else state]
            if state == "warmup":
                warmed, _ = run(warmup_command(family, args.seq_len), cache)
                say(f"{family:<17} dilated-attn warmup --backend fa4: {warmed:.1f} s")
            child_argv = [sys.executable, __file__, "--child", family, "--seq-len", str(args.seq_len),
                          "--backend", args.backend] + (["--profile"] if args.profile else [])
            wall, out = run(child_argv, cache)
            row = dict(family=family, cache=state, process_s=wall, **json.loads(out.strip().splitlines()[-1]))
            if state == "warmup":
                row["warmup_s"] = warmed
            rows.append(row)
            say(f"{family:<17} {state}: import {row['import_s']:.2f} s, torch's first backward "
                f"{row['torch_first_backward_s']:.2f} s, then the first fwd+bwd {row['first_call_s']:6.2f} s "
                f"(second {row['second_call_s'] * 1e3:.1f} ms), process {wall:6.2f} s, backend {row['backend']}, "
                f"flash-attn-4 imported: {row['flash_attn_imported']}, {row['stored_programs_loaded']} stored "
                f"programs loaded, {row['compiled']} Triton kernels compiled in {row['compile_s']:.1f} s, "
                f"{row['benchmarked_configs']} configs benchmarked")
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    if args.main:
        log = open(args.log, "w") if args.log else None
        with tempfile.TemporaryDirectory(prefix="triton_cache_") as cache:
            for state in ("cold", "warm"):
                wall, _ = run([sys.executable, "-m", "dilated_attn"], cache, log)
                rows.append(dict(family="python -m dilated_attn", cache=state, process_s=wall))
                say(f"python -m dilated_attn {state}: {wall:.1f} s")
        if log is not None:
            log.close()
    if args.out:
        record = dict(device=device_info(torch.device("cuda")), versions=versions(), command=command_line(),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      seq_len=args.seq_len, rows=rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
