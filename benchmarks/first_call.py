"""What the first call costs: the first forward+backward of `dilated_attention` in a new process, with an empty
Triton cache (cold) and with the cache the cold run filled (warm); optionally `python -m dilated_attn` the same way.

    python benchmarks/first_call.py                          # the three families, cold and warm
    python benchmarks/first_call.py --main --out first.json  # and the `dilated-attn` command

Each measurement runs in a fresh process whose TRITON_CACHE_DIR is a new directory (cold) or the one its cold run
filled (warm). A process reports the seconds of its first call (inputs ready to gradients synchronised), of the
whole process (interpreter start included), how many Triton kernels it compiled (cache misses) and for how long,
and how many autotuning configs it benchmarked. The JSON names the device and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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


def child(family: str, seq_len: int) -> None:
    """One first call, reported as a JSON line on stdout."""
    import torch
    import triton
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    import dilated_attn
    from dilated_attn.benchmarking import LONGNET, random_inputs

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
    decision = dilated_attn.explain(q, k, v, segments, dilations, causal=causal)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = dilated_attn.dilated_attention(q, k, v, segments, dilations, causal=causal)
    torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = dilated_attn.dilated_attention(q, k, v, segments, dilations, causal=causal)
    torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    knobs.compilation.listener = previous
    print(json.dumps(dict(first_call_s=first, second_call_s=second, backend=decision.backend,
                          compiled=len(compiled), compile_s=sum(t for _, t in compiled),
                          compiled_kernels=sorted({name for name, _ in compiled}),
                          benchmarked_configs=len(benched), triton=triton.__version__)), flush=True)


def run(argv: list[str], cache: str, log=None) -> tuple[float, str]:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
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
    parser.add_argument("--main", action="store_true", help="also time `python -m dilated_attn`, cold and warm")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    parser.add_argument("--log", default=None, help="where the `python -m dilated_attn` output goes")
    parser.add_argument("--child", choices=list(FAMILIES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seq_len)
        return

    import torch

    from dilated_attn.benchmarking import command_line, device_info, say, versions

    rows = []
    for family in args.families:
        with tempfile.TemporaryDirectory(prefix="triton_cache_") as cache:
            for state in ("cold", "warm"):
                wall, out = run([sys.executable, __file__, "--child", family, "--seq-len", str(args.seq_len)], cache)
                row = dict(family=family, cache=state, process_s=wall, **json.loads(out.strip().splitlines()[-1]))
                rows.append(row)
                say(f"{family:<17} {state}: first fwd+bwd {row['first_call_s']:6.2f} s (second "
                    f"{row['second_call_s'] * 1e3:.1f} ms), process {wall:6.2f} s, {row['compiled']} kernels "
                    f"compiled in {row['compile_s']:.1f} s, {row['benchmarked_configs']} configs benchmarked, "
                    f"backend {row['backend']}")
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
