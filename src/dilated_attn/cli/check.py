"""The `check` command's self-check: every backend that can run here (or those named), forward and backward on
a small random problem, against dilated_attention_reference in float64, by the package's tolerance rule
(dilated_attn.reference.allowed_error). CHECK_* are its problem, sizes chosen to reach the kernels' edge cases;
the backends of OWN_PROBLEM (cudnn) run on one of their own. self_check prints PASS/FAIL/SKIP per backend, dtype
and case and returns the rows; the `check` command (dilated_attn.cli) turns them into its exit status.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..backends import REGISTRY
from ..backends import verdicts as backend_verdicts
from ..functional import dilated_attention
from ..reference import allowed_error, dilated_attention_reference, max_error
from ..spec import Problem, validate
from .measure import DTYPES, applicable_backends, say

__all__ = [
    "CHECK_SHAPE", "CHECK_BRANCHES", "CHECK_CASES", "CHECK_DTYPES", "CUDNN_CHECK_SHAPE", "CUDNN_CHECK_BRANCHES",
    "OWN_PROBLEM", "CheckProblem", "check_problem", "check_plan", "check_problems", "self_check",
]

# The self-check problem: GQA, an N no segment length divides, a segment longer than N (256 > 203), a head
# dim that is not a power of two (the padded paths of the kernels), and with head_groups="split" positions
# no branch covers. Every branch has at most 64 members per segment: one members bucket of the Triton config
# table, so a GPU's first check compiles few kernels.
CHECK_SHAPE = dict(batch=2, seq_len=203, heads=4, kv_heads=2, head_dim=40)
CHECK_BRANCHES = ([64, 128, 256], [1, 2, 4])
CHECK_CASES = (dict(causal=False, head_groups="all"), dict(causal=True, head_groups="split"))
CHECK_DTYPES = ("float32", "bfloat16")

# The cudnn backend's own problem: one it takes (CudnnBackend.why_not): D = 64 (a multiple of 8, as cuDNN needs,
# and a head dim of real models), grouped-query heads as most models have them. N is a multiple of the first segment, so
# that the first branch (dilation 1) gives the starting result; the two dilated branches, each with a shorter last
# segment, are merged into it by the merge kernel in the forward and added by the gradient-addition kernel in the
# backward. Its loss has no LSE term: given an LSE gradient, another backend's backward runs instead of cuDNN's
# (which takes none).
CUDNN_CHECK_SHAPE = dict(batch=2, seq_len=448, heads=4, kv_heads=2, head_dim=64)
CUDNN_CHECK_BRANCHES = ([64, 128, 256], [1, 2, 4])
# Backends checked on a problem of their own wherever they apply to the device: cudnn, and fa4 (FlashAttention-4,
# which auto runs on Hopper GPUs where flash-attn-4 is installed, but only from the sizes of a benchmark: the main
# problem never reaches it) on cudnn's shape, with the LSE term (its backward takes the LSE's gradient).
OWN_PROBLEM = ("cudnn", "fa4")


def _outputs(fn, inputs, grad_out, grad_lse) -> dict:
    """out, lse and the gradients of <out, grad_out> + <lse, grad_lse> (over covered positions), in float64;
    with grad_lse None, of <out, grad_out> alone (the LSE then has no gradient)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    loss = (out.double() * grad_out).sum()
    if grad_lse is not None:
        loss = loss + (lse.double().masked_fill(~torch.isfinite(lse), 0) * grad_lse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return dict(out=out.double(), lse=lse.double(), **{f"d{n}": g.double() for n, g in zip("qkv", grads)})


def _worst_error(got: dict, ref: dict, dtype_ref: dict, dtype: torch.dtype) -> tuple[float, float, str]:
    """(error, allowed error, name) of the output of out, lse and the gradients nearest its allowed error, by the
    package's tolerance rule (dilated_attn.reference.allowed_error; dtype_ref: the reference computed in dtype).
    Positions without keys (lse -inf) must match exactly; a NaN error is an infinite one."""
    worst = (0.0, 1.0, "out")
    for name, r in ref.items():
        g, low = got[name], dtype_ref[name]
        if name == "lse":
            covered = torch.isfinite(r)
            if not torch.equal(covered, torch.isfinite(g)):
                return math.inf, 0.0, name
            g, r, low = g[covered], r[covered], low[covered]
        err = max_error(g, r)
        err = math.inf if math.isnan(err) else err
        largest = r.abs().max().item() if r.numel() else 0.0
        allowed = allowed_error(dtype, max_error(low, r), gradient=name.startswith("d"), largest=largest)
        if err / allowed > worst[0] / worst[1]:
            worst = (err, allowed, name)
    return worst


class CheckProblem(NamedTuple):
    """A problem of the self-check: its sizes, branches and cases, and whether the loss whose gradients are
    compared has an LSE term."""

    shape: dict
    branches: tuple
    cases: tuple
    lse_gradient: bool = True

    def describe(self) -> str:
        s = self.shape
        heads = f"Hq={s['heads']} Hkv={s['kv_heads']}" if s["kv_heads"] != s["heads"] else f"H={s['heads']}"
        branches = ", ".join(f"({w}, {r})" for w, r in zip(*self.branches))
        return (f"B={s['batch']} N={s['seq_len']} {heads} D={s['head_dim']}, branches {branches}"
                + ("" if self.lse_gradient else ", no LSE term in the loss (cuDNN's backward takes none)"))


def check_problem(backend: Optional[str] = None) -> CheckProblem:
    """The problem `backend` is checked on: the main one, or for those of OWN_PROBLEM their own."""
    if backend in OWN_PROBLEM:
        return CheckProblem(CUDNN_CHECK_SHAPE, CUDNN_CHECK_BRANCHES, CHECK_CASES, lse_gradient=backend != "cudnn")
    return CheckProblem(CHECK_SHAPE, CHECK_BRANCHES, CHECK_CASES)


def check_plan(device: torch.device, backends=None) -> list[tuple[CheckProblem, Optional[list[str]]]]:
    """The self-check's problems, each with the backends it checks (None: those the auto rule considers for each
    dtype and case, but OWN_PROBLEM's): the main problem with every backend that applies to the device, or those
    named, but OWN_PROBLEM's; then each of OWN_PROBLEM that applies to the device (the cudnn backend: CUDA
    tensors) or is named, on its own problem. Problems with nothing to check are left out."""
    if backends:
        plan = [(check_problem(), [n for n in backends if n not in OWN_PROBLEM])]
        plan += [(check_problem(n), [n]) for n in OWN_PROBLEM if n in backends]
    else:
        plan = [(check_problem(), None)]
        plan += [(check_problem(n), [n]) for n in OWN_PROBLEM
                 if device.type in REGISTRY[n].supported_device_types()]
    return [(problem, names) for problem, names in plan if names is None or names]


def check_problems(device: torch.device, dtypes, backend: Optional[str] = None) -> list:
    """The self-check's problems (validated, from sizes) for `backend` (None: the main problem's backends):
    one per dtype and case."""
    problem = check_problem(backend)
    return [Problem.from_sizes(**problem.shape, segment_lengths=problem.branches[0],
                               dilation_rates=problem.branches[1], dtype=DTYPES[d], device=device, **case)
            for d in dtypes for case in problem.cases]


def self_check(device: torch.device, dtypes=CHECK_DTYPES, backends=None) -> list[dict]:
    """Runs every backend that applies to `device` (or those named) on a small random problem, forward and
    backward, against dilated_attention_reference in float64, and prints PASS/FAIL/SKIP per backend, dtype
    and case (SKIP: a backend not named that cannot run; one line for a backend whose package is not installed). The
    backends of OWN_PROBLEM run on a problem of their own (CUDNN_CHECK_SHAPE). Returns the rows."""
    plan = check_plan(device, backends)
    say(f"self-check against the float64 reference: {plan[0][0].describe()}; forward and backward on {device}")
    if device.type == "cuda":
        # Triton caches compiled kernels on disk; on a cold cache each new family's kernels take seconds to
        # compile (float32 ones longer), so a first run is slow without anything being wrong. cuDNN keeps its
        # plans in the process: its first calls build them in every run, for seconds.
        note = "the first run on a machine compiles the Triton kernels: about half a minute"
        if any(names and "cudnn" in names for _, names in plan) and any(
                backend_verdicts(p)["cudnn"] is None for p in check_problems(device, dtypes, "cudnn")):
            note += "; cudnn's first calls build cuDNN's plans, in every process: seconds"
        say(f"  ({note})")
    say(f"  {'backend':<10} {'dtype':<9} {'case':<18} {'max error':>9} {'(where)':<7} {'tolerance':>9}  result")
    rows = []
    for i, (problem, names) in enumerate(plan):
        missing = {n: REGISTRY[n].unavailable() for n in names or ()}
        if names and all(missing.values()):  # not installed: one line, not one SKIP per dtype and case
            for name in names:
                rows.append(dict(backend=name, result="SKIP", reason=missing[name]))
                say(f"  {name}: not checked: {missing[name]}")
            continue
        if i:
            say(f"  {', '.join(names)} on a problem it takes: {problem.describe()}")
        rows += _check_problem(device, problem, dtypes, names)
    failed = sum(r["result"] == "FAIL" for r in rows)
    passed = sum(r["result"] == "PASS" for r in rows)
    say(f"self-check: {passed} passed, {failed} failed, {len(rows) - passed - failed} skipped")
    return rows


def _check_problem(device: torch.device, problem: CheckProblem, dtypes, names) -> list[dict]:
    """The rows of one problem: each backend of `names` (None: those the auto rule considers, but OWN_PROBLEM's)
    for each case and dtype, printed as they finish."""
    s, branches = problem.shape, problem.branches
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in problem.cases:
        label = f"{'causal' if case['causal'] else 'non-causal'}, {case['head_groups']}"
        # Drawn once in float64 on the CPU, so that every dtype and backend starts from the same numbers.
        q, k, v = (torch.randn(s["batch"], s["seq_len"], h, s["head_dim"], generator=gen, dtype=torch.float64)
                   for h in (s["heads"], s["kv_heads"], s["kv_heads"]))
        grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
        grad_lse = torch.randn(s["batch"], s["heads"], s["seq_len"], generator=gen, dtype=torch.float64).to(device)
        if not problem.lse_gradient:
            grad_lse = None
        for name_of_dtype in dtypes:
            dtype = DTYPES[name_of_dtype]
            inputs = [x.to(device, dtype) for x in (q, k, v)]
            p = validate(*inputs, *branches, **case)
            found = backend_verdicts(p)
            checked = names if names is not None else [n for n in applicable_backends(p) if n not in OWN_PROBLEM]
            ref = dtype_ref = None
            for name in checked:
                row = dict(backend=name, dtype=name_of_dtype, case=label)
                if found[name] is not None:
                    rows.append(dict(row, result="SKIP", reason=found[name]))
                    say(f"  {name:<10} {name_of_dtype:<9} {label:<18} SKIP: {found[name]}")
                    continue
                if ref is None:  # the truth: the reference in float64 on the same (rounded) inputs; and in dtype
                    ref = _outputs(lambda *x: dilated_attention_reference(*x, *branches, **case),
                                   [x.double() for x in inputs], grad_out, grad_lse)
                    dtype_ref = _outputs(lambda *x: dilated_attention_reference(*x, *branches, compute_dtype=dtype,
                                                                                **case), inputs, grad_out, grad_lse)
                try:
                    got = _outputs(lambda *x: dilated_attention(*x, *branches, **case, return_lse=True,
                                                                backend=name), inputs, grad_out, grad_lse)
                except Exception as exc:  # noqa: BLE001 - a backend that crashes fails; the others still run
                    rows.append(dict(row, result="FAIL", reason=f"{type(exc).__name__}: {exc}"))
                    say(f"  {name:<10} {name_of_dtype:<9} {label:<18} FAIL: raised {type(exc).__name__}: {exc}")
                    continue
                err, tol, where = _worst_error(got, ref, dtype_ref, dtype)
                result = "PASS" if err <= tol else "FAIL"
                rows.append(dict(row, result=result, error=err, tolerance=tol, where=where))
                say(f"  {name:<10} {name_of_dtype:<9} {label:<18} {err:9.2e} {'(' + where + ')':<7} {tol:9.1e}  "
                    f"{result}")
    return rows

