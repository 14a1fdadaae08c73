"""`python -m dilated_attn` (console script `dilated-attn`): environment report, self-check, benchmark.

    python -m dilated_attn          # all three: env, check, then a short benchmark sized for the device
    python -m dilated_attn env      # python, torch, CUDA, GPUs, triton, build_info(), backend verdicts
    python -m dilated_attn check    # every backend that can run here against the float64 reference
    python -m dilated_attn bench --seq-len 16384 65536 --json out.json   # sized for a GPU (minutes on a CPU)
    python -m dilated_attn bench --plot out.png    # the device's default sizes; --plot needs matplotlib
    python -m dilated_attn warmup --dtype bfloat16 --head-dim 128 --causal both   # compile kernels ahead of time
    python -m dilated_attn warmup --backend fa4 --seq-len 16384 --heads 16 --segment-lengths 2048 4096 \\
        --dilation-rates 1 2 --causal true     # FlashAttention-4's kernels of these shapes, into its disk cache

Exit status: 0 when all is well; 1 when the self-check (or the warm-up of a family) fails; 2 for bad arguments
(argparse's errors, and attention configurations the package rejects, with its ValueError message); 3 when a
backend named with --backends (or warmup's --backend) cannot run on this device or configuration (with the
package's reason). Backends not named that cannot run are skipped. docs/cli.md is the reference. The self-check is
dilated_attn.cli.check's, the bench command's run dilated_attn.cli.bench's, and their measuring (and the plots)
dilated_attn.cli.measure's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from typing import Optional

import torch

from .. import __version__, build_info
from ..backends import FA4
from ..backends import triton as triton_backend
from ..backends import verdicts as backend_verdicts
from ..spec import BACKEND_NAMES, Problem, dtype_name
from .bench import BENCH_DEFAULTS, BenchConfig, bench_plan, print_table, refusals, run_bench
from .check import CHECK_DTYPES, check_problems, self_check
from .measure import DTYPES, PASSES, Record, device_info, matplotlib_missing, plot_rows, say, triton_version

__all__ = ["main", "build_parser", "environment", "print_environment", "EXIT_CHECK_FAILED", "EXIT_CANNOT_RUN"]

EXIT_CHECK_FAILED = 1
EXIT_CANNOT_RUN = 3  # (2: argparse's status for bad arguments)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def use_device(device: torch.device) -> torch.device:
    """Makes a GPU the current device: CUDA events, memory statistics and kernel launches follow it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def cannot_run(refused: dict[str, str], prog: str) -> int:
    """Reports each backend named with --backends that cannot run, with the package's reason, as argparse
    reports errors (the program's name first)."""
    for name, why in refused.items():
        print(f"{prog}: error: backend {name!r} cannot run here: {why}", file=sys.stderr, flush=True)
    return EXIT_CANNOT_RUN


# --- env ------------------------------------------------------------------------------------------------


def environment(device: torch.device | None = None) -> dict:
    """What this process runs with, as plain data (printed by `env`, stored in the benchmark JSON)."""
    device = device or default_device()
    triton, triton_error = triton_version()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(dict(index=i, name=props.name, capability=f"{props.major}.{props.minor}",
                             memory_gib=round(props.total_memory / 2**30, 1)))
    dtype = DTYPES[BENCH_DEFAULTS[device.type]["dtype"]]
    p = Problem.from_sizes(batch=1, seq_len=1, heads=1, kv_heads=1, head_dim=64, segment_lengths=[1],
                           dilation_rates=[1], dtype=dtype, device=device)
    return dict(
        dilated_attn=dict(version=__version__, path=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        python=dict(version=platform.python_version(), executable=sys.executable),
        platform=platform.platform(),
        cpu_threads=torch.get_num_threads(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        gpus=gpus,
        triton=triton,
        triton_error=triton_error,
        # Why the triton backend is unavailable even where triton itself imports (None if it loaded).
        triton_backend_error=triton_backend.load_error() if triton else None,
        build_info=build_info(),
        variables={k: os.environ[k] for k in ("DILATED_ATTN_BACKEND", "TRITON_INTERPRET",
                                              "DILATED_ATTN_AUTOTUNE", "CUDA_VISIBLE_DEVICES")
                   if k in os.environ},
        verdicts=dict(device=str(device), dtype=dtype_name(dtype), head_dim=64, backends=backend_verdicts(p)),
    )


def print_environment(env: dict) -> None:
    say(f"dilated_attn {env['dilated_attn']['version']} ({env['dilated_attn']['path']})")
    say(f"  python       {env['python']['version']} ({env['python']['executable']})")
    say(f"  platform     {env['platform']}; {env['cpu_threads']} CPU threads")
    say(f"  torch        {env['torch']} (CUDA build: {env['torch_cuda'] or 'none'})")
    if env["gpus"]:
        for g in env["gpus"]:
            say(f"  GPU {g['index']}        {g['name']}, compute capability {g['capability']}, {g['memory_gib']} GiB")
    else:
        say("  CUDA         not available")
    if env["triton"]:
        why = env["triton_backend_error"]
        note = f" (the triton backend did not load: {why})" if why else ""
        say(f"  triton       {env['triton']}{note}")
    elif not env["gpus"] and (env["triton_error"] or "").startswith("ModuleNotFoundError"):
        say("  triton       not installed (only the triton backend, for CUDA GPUs, needs it)")
    else:
        say(f"  triton       not available ({env['triton_error']})")
    say(f"  build_info   {', '.join(f'{k}={v}' for k, v in env['build_info'].items())}")
    for name, value in env["variables"].items():
        say(f"  {name}={value}")
    v = env["verdicts"]
    say(f"  backends for {v['device']} {v['dtype']} tensors:")
    for name, why in v["backends"].items():
        say(f"    {name:<10} {'can run' if why is None else why}")


# --- command line ---------------------------------------------------------------------------------------


def _int_at_least(minimum: int, rule: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def device_arg(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:index], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:index], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available (torch {torch.__version__}, CUDA build: "
                                         f"{torch.version.cuda or 'none'})")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} GPUs")
    return device


def build_parser() -> argparse.ArgumentParser:
    script = bool(sys.argv) and sys.argv[0].endswith("dilated-attn")  # the console script, else python -m
    prog = os.path.basename(sys.argv[0]) if script else "python -m dilated_attn"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(command=None, fail=parser.error)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="{env,check,bench,warmup}")
    env = sub.add_parser("env", help="report the environment and what each backend can run")
    env.add_argument("--device", type=device_arg, default=None,
                     help="device for the verdicts (default: cuda if available, else cpu)")
    env.set_defaults(command="env")
    check = sub.add_parser("check", help="self-check every backend that can run here against the reference")
    check.add_argument("--device", type=device_arg, default=None, help="default: cuda if available, else cpu")
    check.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(CHECK_DTYPES), dest="dtypes",
                       help=f"default: {' '.join(CHECK_DTYPES)}")
    check.add_argument("--backends", nargs="+", choices=BACKEND_NAMES, default=None,
                       help="default: every backend that applies to the device, those that cannot run skipped; "
                            f"a backend named that cannot run is an error (exit status {EXIT_CANNOT_RUN})")
    check.set_defaults(command="check", fail=check.error, prog=check.prog)
    b = sub.add_parser("bench", help="time backends (defaults: a size suited to the device)",
                       description="Times backends forward and forward+backward, printing each measurement as it "
                                   "finishes and writing --json/--csv after every row. Flags left out take the "
                                   "device's defaults: " + "; ".join(f"{device}: {defaults_config(device).describe()}"
                                                                     for device in BENCH_DEFAULTS))
    b.add_argument("--device", type=device_arg, default=None, help="default: cuda if available, else cpu")
    b.add_argument("--batch", type=positive_int)
    b.add_argument("--seq-len", type=positive_int, nargs="+", help="one or more sequence lengths N")
    b.add_argument("--heads", type=positive_int, help="query heads")
    b.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    b.add_argument("--head-dim", type=positive_int)
    b.add_argument("--segment-lengths", type=int, nargs="+", help="w of each branch (with --dilation-rates)")
    b.add_argument("--dilation-rates", type=int, nargs="+", help="r of each branch (with --segment-lengths)")
    b.add_argument("--dtype", choices=list(DTYPES))
    b.add_argument("--causal", action="store_true")
    b.add_argument("--mode", choices=list(PASSES), default="both",
                   help="fwd, fwdbwd (forward+backward) or both (default)")
    b.add_argument("--backends", nargs="+", choices=BACKEND_NAMES,
                   help="default: every backend that applies to the device and can run; a backend named that "
                        f"cannot run is an error (exit status {EXIT_CANNOT_RUN})")
    b.add_argument("--repeats", type=positive_int, help="timed runs per measurement; the median is reported")
    b.add_argument("--warmup", type=non_negative_int, help="untimed runs before them")
    b.add_argument("--json", metavar="PATH", help="write the rows, configuration and environment as JSON")
    b.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    b.add_argument("--plot", metavar="FILE.png", help="plot the metric against N per backend (needs matplotlib)")
    b.add_argument("--plot-metric", choices=["tflops", "ms"], default="tflops", help="default: tflops")
    b.set_defaults(command="bench", fail=b.error, prog=b.prog)
    w = sub.add_parser("warmup", help="compile the kernels a training run needs, before it starts",
                       description="Compiles the Triton kernels of each (dtype, head dim, causal) family into "
                                   "Triton's on-disk cache (TRITON_CACHE_DIR), several families at once in separate "
                                   "processes, so that a training run's first step does not wait for them. With "
                                   "DILATED_ATTN_AUTOTUNE=1 it also runs (and caches) the full sweep, one family "
                                   "at a time. With --backend fa4 it compiles FlashAttention-4's kernels of the "
                                   "training run's shapes (--seq-len or --pack-lengths, --heads, --segment-lengths, "
                                   "--dilation-rates) into its disk cache (DILATED_ATTN_FA4_CACHE).")
    w.add_argument("--backend", choices=WARMUP_BACKENDS, default="triton",
                   help="triton (default) or fa4 (FlashAttention-4, whose kernels depend on the shapes below)")
    w.add_argument("--device", type=device_arg, default=None, help="default: the current CUDA device")
    w.add_argument("--dtype", nargs="+", choices=["bfloat16", "float16", "float32"], default=["bfloat16"],
                   dest="dtypes", help="default: bfloat16")
    w.add_argument("--head-dim", nargs="+", type=head_dim_arg, default=[128], dest="head_dims",
                   help=f"default: 128 (at most {triton_backend.TRITON.forward_op.max_head_dim}; fa4: "
                        f"{FA4.forward_op.max_head_dim})")
    w.add_argument("--causal", choices=list(CAUSAL_SETTINGS), default="both",
                   help="which masking to compile for (default: both)")
    w.add_argument("--allow-tf32", action="store_true",
                   help="float32 with TF32 products, as under torch.backends.cuda.matmul.allow_tf32 = True")
    w.add_argument("--jobs", type=positive_int, default=None,
                   help="triton: families compiled at once, each in its own process (default: min(4, CPUs))")
    shapes = w.add_argument_group("fa4: the shapes of the training run's attention calls")
    shapes.add_argument("--seq-len", type=positive_int, nargs="+", help="one or more sequence lengths N")
    shapes.add_argument("--pack-lengths", type=positive_int, nargs="+",
                        help="the sequences' lengths of a typical pack (dilated_attention_varlen)")
    shapes.add_argument("--batch", type=positive_int, help="B (default 1: it changes no kernel)")
    shapes.add_argument("--heads", type=positive_int, help="query heads")
    shapes.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    shapes.add_argument("--segment-lengths", type=int, nargs="+", help="w of each branch")
    shapes.add_argument("--dilation-rates", type=int, nargs="+", help="r of each branch")
    shapes.add_argument("--head-groups", choices=["all", "split"], help="default: all")
    shapes.add_argument("--lse-gradient", action="store_true",
                        help="also the backward of a loss that uses the LSE (return_lse=True)")
    shapes.add_argument("--deterministic", action="store_true",
                        help="the backward of torch.use_deterministic_algorithms(True), which has kernels of its own")
    w.set_defaults(command="warmup", fail=w.error, prog=w.prog)
    return parser


def head_dim_arg(text: str) -> int:
    value = positive_int(text)
    largest = triton_backend.TRITON.forward_op.max_head_dim
    if value > largest:
        raise argparse.ArgumentTypeError(f"must be at most {largest} (the triton backend's largest head dim), got "
                                         f"{value}")
    return value


def defaults_config(device_type: str) -> BenchConfig:
    d = BENCH_DEFAULTS[device_type]
    return BenchConfig(device=torch.device(device_type), dtype=DTYPES[d["dtype"]], kv_heads=d["heads"],
                       **{k: v for k, v in d.items() if k != "dtype"})


def bench_config(args) -> BenchConfig:
    """The benchmark's configuration: the flags given, the device's defaults for the rest."""
    device = args.device or default_device()
    if (args.segment_lengths is None) != (args.dilation_rates is None):
        args.fail("--segment-lengths and --dilation-rates go together: give both or neither")
    sizes = {key: default if getattr(args, key) is None else getattr(args, key)
             for key, default in BENCH_DEFAULTS[device.type].items()}
    return BenchConfig(device=device, dtype=DTYPES[sizes.pop("dtype")], kv_heads=args.kv_heads or sizes["heads"],
                       causal=args.causal, mode=args.mode, **sizes)


def bench_command(args, env=None, failed: frozenset = frozenset()) -> int:
    """The `bench` command: plan (all refusals before anything runs), time, table, files, plot. `failed`: backends
    that failed the self-check run before (the default run): not timed."""
    if args.plot and matplotlib_missing():  # before a long run, not after it
        args.fail(f"--plot: {matplotlib_missing()}")
    cfg = bench_config(args)
    use_device(cfg.device)
    try:
        planned = bench_plan(cfg, args.backends)
    except (ValueError, TypeError) as exc:  # the package's own message for an invalid configuration
        args.fail(str(exc))
    if planned.refused:
        return cannot_run(planned.refused, args.prog)
    device = device_info(cfg.device)
    where = device["name"] + (f", {device['threads']} threads" if "threads" in device else "")
    timing = "CUDA events, L2 flushed before each run" if cfg.device.type == "cuda" else "time.perf_counter"
    say(f"benchmark on {cfg.device} ({where}): {cfg.describe()} ({timing})")
    for name, why in planned.skipped.items():
        say(f"  {name}: skipped ({why})")
    for name in sorted(failed & {n for names in planned.backends.values() for n in names}):
        say(f"  {name}: not timed (it failed the self-check above)")
    timed = {n: [name for name in names if name not in failed] for n, names in planned.backends.items()}
    try:
        record = Record("python -m dilated_attn bench", cfg.device, cfg.as_json(), json_path=args.json,
                        csv_path=args.csv, command=args.command_line, environment=env or environment(cfg.device))
    except OSError as exc:
        args.fail(f"--json/--csv: {exc}")
    rows = run_bench(cfg, timed, record)
    print_table(rows)
    record.close()
    if args.plot:
        metric = "median_ms" if args.plot_metric == "ms" else "tflops"
        title = f"{device['name']}, {dtype_name(cfg.dtype)}, B={cfg.batch} H={cfg.heads} D={cfg.head_dim}"
        plot_rows(rows, args.plot, metric, title)
        say(f"wrote {args.plot}")
    return 0


def check_command(device: torch.device, dtypes, backends, prog: str = "dilated-attn check",
                  rows: Optional[list] = None) -> int:
    """The `check` command: refuses backends named that can run none of the check's problems here, else runs the
    self-check (its rows appended to `rows` where given; a dtype or case a named backend cannot run is a SKIP with the
    reason)."""
    refused = {}
    for name in backends or ():
        problems = check_problems(device, dtypes, name)
        if all(refusals([p], [name]) for p in problems):
            refused.update(refusals(problems, [name]))
    if refused:
        return cannot_run(refused, prog)
    found = self_check(use_device(device), dtypes, backends)
    if rows is not None:
        rows += found
    return EXIT_CHECK_FAILED if any(r["result"] == "FAIL" for r in found) else 0


WARMUP_BACKENDS = ("triton", "fa4")
CAUSAL_SETTINGS = {"both": (False, True), "true": (True,), "false": (False,)}  # warmup's --causal
FA4_WARMUP_FLAGS = ("seq_len", "pack_lengths", "batch", "heads", "kv_heads", "segment_lengths", "dilation_rates",
                    "head_groups", "lse_gradient", "deterministic")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def warmup_command(args) -> int:
    """The `warmup` command: every family compiled; exit status 1 if one failed."""
    from ..warmup import warmup

    if args.backend == "fa4":
        return fa4_warmup_command(args)
    given = [dest for dest in FA4_WARMUP_FLAGS if getattr(args, dest) not in (None, False)]
    if given:
        args.fail(f"{_flag(given[0])}: only with --backend fa4 (the triton warm-up compiles every shape of a family)")
    if not torch.cuda.is_available():
        args.fail(f"warmup compiles the Triton kernels for a CUDA GPU, and CUDA is not available (torch "
                  f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    if triton_backend.load_error() is not None:
        args.fail(f"the triton backend cannot load: {triton_backend.load_error()}")
    device = use_device(args.device or default_device())
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    causal = CAUSAL_SETTINGS[args.causal]
    jobs = min(4, os.cpu_count() or 1) if args.jobs is None else args.jobs
    results = warmup(device, args.dtypes, args.head_dims, causal, jobs, say)
    return EXIT_CHECK_FAILED if any(error for *_, error in results) else 0


def fa4_warmup_command(args) -> int:
    """`warmup --backend fa4`: the fa4 backend run once at each family of the given shapes, in this process,
    which fills FlashAttention-4's disk cache for the training processes; exit status 3 where fa4 cannot run."""
    from ..warmup import fa4_families, fa4_refusal, warmup_fa4

    for dest, rule in (("jobs", "one process compiles them all"), ("allow_tf32", "fa4 takes float16 and bfloat16")):
        if getattr(args, dest) not in (None, False):
            args.fail(f"{_flag(dest)}: only with --backend triton ({rule})")
    missing = [_flag(dest) for dest in ("heads", "segment_lengths", "dilation_rates") if getattr(args, dest) is None]
    if not args.seq_len and not args.pack_lengths:
        missing.append("--seq-len or --pack-lengths")
    if missing:
        needs = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        args.fail(f"--backend fa4 needs {needs}: FlashAttention-4 compiles kernels for the calls' "
                  f"lengths and heads, so it warms the training run's shapes")
    device = args.device or default_device()
    causal = CAUSAL_SETTINGS[args.causal]
    try:
        families = fa4_families(device, heads=args.heads, segment_lengths=args.segment_lengths,
                                dilation_rates=args.dilation_rates, seq_lens=args.seq_len or (),
                                pack_lengths=args.pack_lengths or (), kv_heads=args.kv_heads, batch=args.batch or 1,
                                dtypes=args.dtypes, head_dims=args.head_dims, causal=causal,
                                head_groups=args.head_groups or "all")
    except (ValueError, TypeError) as exc:  # the package's own message for an invalid configuration
        args.fail(str(exc))
    why = fa4_refusal(families)
    if why is not None:
        return cannot_run({"fa4": why}, args.prog)
    use_device(device)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        results = warmup_fa4(families, lse_gradient=args.lse_gradient, say=say)
    except RuntimeError as exc:  # flash-attn-4 is installed but does not load
        return cannot_run({"fa4": FA4.unavailable() or str(exc)}, args.prog)
    return EXIT_CHECK_FAILED if any(error for *_, error in results) else 0


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly (recipe of the Python docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "-m", "dilated_attn", *argv])
    if args.command == "env":
        print_environment(environment(args.device or default_device()))
        return 0
    if args.command == "check":
        return check_command(args.device or default_device(), args.dtypes, args.backends, args.prog)
    if args.command == "bench":
        return bench_command(args)
    if args.command == "warmup":
        return warmup_command(args)
    # No command: all three, the benchmark at the device's default size.
    device = default_device()
    env = environment(device)
    print_environment(env)
    say()
    checked: list = []
    status = check_command(device, CHECK_DTYPES, None, rows=checked)
    say()
    bench_args = parser.parse_args(["bench"])
    bench_args.command_line = args.command_line
    failed = frozenset(r["backend"] for r in checked if r["result"] == "FAIL")
    return bench_command(bench_args, env, failed) or status
