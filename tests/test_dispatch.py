"""Backend selection: every backend's verdict, the auto rule and its one-time fallback warnings, explicit
backends, the DILATED_ATTN_BACKEND override, explain(), and torch.compile(fullgraph=True) through it all."""

import dataclasses
import warnings

import pytest
import torch

import dilated_attn
from dilated_attn import backends, compile_hints, dispatch
from dilated_attn.backends import base, extension
from dilated_attn.backends import triton as triton_backend
from dilated_attn.backends.reference import memory_bytes as reference_memory_bytes
from dilated_attn.reference import dilated_attention_reference
from dilated_attn.spec import validate

SEGS, DILS = [8, 16], [1, 2]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Every test starts with no warning given yet, no backend forced and no compiled code of another test (the
    environment variable is read when a compiled function is traced, so a stale trace would hide it)."""
    monkeypatch.setattr(compile_hints, "_WARNED", set())
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture
def no_cpu_kernels(monkeypatch):
    """A build of the extension without CPU kernels, as the CPU backend sees it."""
    monkeypatch.setattr(extension, "_KERNELS", {"cpu": False, "cuda": False})


@pytest.fixture
def runs(monkeypatch):
    """Which backends actually ran (each backend's forward wrapped by a recorder)."""
    calls = []
    for name, b in backends.REGISTRY.items():
        def forward(q, k, v, p, _name=name, _forward=b.forward):
            calls.append(_name)
            return _forward(q, k, v, p)
        monkeypatch.setattr(b, "forward", forward)
    return calls


def _qkv(B=2, N=37, Hq=4, Hkv=2, D=8, dtype=torch.float32, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(1)
    shapes = ((B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
            .requires_grad_(requires_grad) for s in shapes]


def _recorded(fn):
    """fn()'s result and the dilated_attn warnings it gave (all of them: the 'always' filter defeats Python's
    own once-per-location rule, so only the package's once-per-reason rule is seen)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "dilated_attn" in str(w.message)]


def _fake_cuda_problem(monkeypatch, capability=(9, 0), dtype=torch.bfloat16, head_dim=128, cuda_kernels=True):
    """A Problem on a CUDA device of the given compute capability, without a GPU: the verdicts only read the
    problem, the extension's kernel table and the device's capability."""
    monkeypatch.setattr(extension, "_KERNELS", {"cpu": True, "cuda": cuda_kernels})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = torch.empty(1, 64, 4, head_dim, dtype=dtype, device="meta")
    return dataclasses.replace(validate(q, q, q, SEGS, DILS), device=torch.device("cuda", 0))


# --- the auto rule ------------------------------------------------------------------------------------------


def test_auto_runs_the_cpu_kernels_on_cpu_without_warning(runs):
    q, k, v = _qkv()
    out, warned = _recorded(lambda: dilated_attn.dilated_attention(q, k, v, SEGS, DILS))
    assert runs == ["cpu"] and warned == []  # cuda/triton do not apply to CPU tensors: nothing to warn about
    torch.testing.assert_close(out, dilated_attention_reference(q, k, v, SEGS, DILS)[0], rtol=1e-5, atol=1e-5)


def test_auto_falls_back_to_the_reference_and_warns_once_per_reason(no_cpu_kernels, monkeypatch, runs):
    q, k, v = _qkv()
    out, warned = _recorded(lambda: dilated_attn.dilated_attention(q, k, v, SEGS, DILS))
    assert runs == ["reference"]
    assert len(warned) == 1 and "runs reference" in warned[0] and "without CPU kernels" in warned[0], warned
    assert torch.equal(out, dilated_attention_reference(q, k, v, SEGS, DILS)[0])
    _, warned = _recorded(lambda: dilated_attn.dilated_attention(q, k, v, SEGS, DILS, causal=True))
    assert warned == []  # the same reason again: no second warning
    # A different reason (the extension not loaded at all) is worth its own warning.
    monkeypatch.setattr(extension, "LOAD_ERROR", "ImportError: no _C")
    _, warned = _recorded(lambda: dilated_attn.dilated_attention(q, k, v, SEGS, DILS))
    assert len(warned) == 1 and "not loaded (ImportError: no _C)" in warned[0], warned


def test_other_devices_run_the_reference_without_warning():
    q, k, v = _qkv(device="meta")
    d, warned = _recorded(lambda: dilated_attn.explain(q, k, v, SEGS, DILS))
    assert d.backend == "reference" and d.fallback is None and warned == []


def test_cuda_backend_rules(monkeypatch):
    """The hand-written CUDA kernels: float16/bfloat16/float32, head_dim <= 256, compute capability >= 6.0,
    and an extension built with CUDA kernels."""
    cuda = backends.REGISTRY["cuda"].why_not
    assert cuda(_fake_cuda_problem(monkeypatch)) is None
    assert cuda(_fake_cuda_problem(monkeypatch, capability=(6, 0), dtype=torch.float16, head_dim=256)) is None
    assert "dtype float64 is not supported" in cuda(_fake_cuda_problem(monkeypatch, dtype=torch.float64))
    assert "head_dim 320 > 256" in cuda(_fake_cuda_problem(monkeypatch, head_dim=320))
    assert "compute capability 5.2 < 6.0" in cuda(_fake_cuda_problem(monkeypatch, capability=(5, 2)))
    assert "built without CUDA kernels" in cuda(_fake_cuda_problem(monkeypatch, cuda_kernels=False))


def test_reasons_list_every_rule_an_input_breaks(monkeypatch):
    """A backend's verdict lists every rule the input breaks: its forward declaration's data, then its own rules;
    its backward declaration adds the call's (an LSE gradient, deterministic algorithms)."""
    monkeypatch.setattr(backends.CUDNN, "unavailable", lambda: None)
    p = _fake_cuda_problem(monkeypatch, capability=(7, 5), dtype=torch.float32, head_dim=132)
    rule = backends.CUDNN.forward_op.capability_rule
    expected = ["dtype float32 is not supported (supported: float16, bfloat16)", "head_dim 132 > 128",
                f"compute capability 7.5 < 8.0 ({rule})", "head_dim 132 is not a multiple of 8 (cuDNN's 16-byte rows)"]
    assert backends.CUDNN.reasons(p) == expected
    assert backends.CUDNN.why_not(p) == "; ".join(expected)
    call_rules = [backends.CUDNN.backward_op.lse_gradient_rule, backends.CUDNN.backward_op.nondeterminism_rule]
    assert backends.CUDNN.backward_reasons(p, lse_gradient=True, deterministic=True) == (expected[:3] + call_rules
                                                                                        + expected[3:])
    assert backends.CUDNN.why_not_backward(lse_gradient=True, deterministic=True) == "; ".join(call_rules)
    assert backends.CUDNN.why_not_backward(lse_gradient=False) is None
    # the declarations alone, as data
    op = base.ForwardOp(device_types=("cuda",), dtypes=(torch.float16,), max_head_dim=64)
    q = torch.empty(1, 64, 4, 128, dtype=torch.float64)
    assert op.reasons(validate(q, q, q, SEGS, DILS)) == [
        "needs CUDA tensors, got cpu", "dtype float64 is not supported (supported: float16)", "head_dim 128 > 64"]
    assert op.backward(takes_lse_gradient=False, lse_gradient_rule="no").call_reasons(lse_gradient=True) == ["no"]
    for b in backends.REGISTRY.values():  # each backward takes what its forward takes
        fields = [f.name for f in dataclasses.fields(base.ForwardOp)]
        assert [getattr(b.backward_op, f) for f in fields] == [getattr(b.forward_op, f) for f in fields], b


def test_device_capability_is_asked_once_per_device(monkeypatch):
    p = _fake_cuda_problem(monkeypatch)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    monkeypatch.setattr(base, "_CAPABILITIES", {})
    for _ in range(3):
        backends.verdicts(p)
        dispatch.decide(p, "auto")
    assert asked == [p.device]


@pytest.mark.parametrize(
    "capability, triton_missing, cuda_kernels, dtype, chosen, skipped",
    [
        ((9, 0), False, True, torch.bfloat16, "triton", []),
        ((6, 1), False, True, torch.bfloat16, "cuda", ["triton cannot (compute capability 6.1 < 7.0"]),
        ((9, 0), True, True, torch.float16, "cuda", ["triton cannot (triton is not available"]),
        ((9, 0), True, False, torch.float32, "reference", ["triton cannot", "cuda cannot (dilated_attn._C was"]),
        ((9, 0), False, True, torch.float64, "reference", ["triton cannot (dtype float64", "cuda cannot (dtype"]),
    ],
)
def test_auto_rule_on_cuda(monkeypatch, capability, triton_missing, cuda_kernels, dtype, chosen, skipped):
    """triton (sm >= 7.0, importable), else cuda, else reference; each passed-over preference says why."""
    if triton_missing:
        monkeypatch.setattr(triton_backend, "load_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    p = _fake_cuda_problem(monkeypatch, capability=capability, dtype=dtype, cuda_kernels=cuda_kernels)
    d = dispatch.decide(p, "auto")
    assert d.backend == chosen and "auto rule for cuda tensors: triton > cuda > reference" in d.decided_by
    if skipped:
        assert all(s in d.fallback for s in skipped), d.fallback
    else:
        assert d.fallback is None
    _assert_select_agrees(p, d)


def _assert_select_agrees(p, d):
    """select() runs decide()'s backend, for auto and for each backend named that can run (select asks the first
    choice alone where it can run)."""
    assert _recorded(lambda: dispatch.select(p, "auto"))[0] is backends.REGISTRY[d.backend]
    for name, why in d.verdicts.items():
        if why is None:
            assert dispatch.select(p, name) is backends.REGISTRY[name]


@pytest.mark.parametrize(
    "capability, allow_tf32, tf32x3_fits, cuda_kernels, head_dim, precision, chosen, order",
    [
        ((9, 0), False, True, True, 128, "tf32x3", "triton", "triton > cuda > reference"),
        ((9, 0), False, True, True, 256, "ieee", "reference", "reference > cuda > triton"),  # > TF32X3_MAX_HEAD_DIM
        ((9, 0), False, False, True, 64, "ieee", "cuda", "cuda > triton > reference"),
        ((9, 0), False, False, True, 128, "ieee", "reference", "reference > cuda > triton"),
        ((8, 0), True, False, True, 128, "tf32", "triton", "triton > cuda > reference"),
        ((7, 5), True, True, True, 256, "tf32", "triton", "triton > cuda > reference"),
        ((7, 5), False, True, True, 64, "ieee", "cuda", "cuda > triton > reference"),
        ((7, 5), False, True, True, 96, "ieee", "reference", "reference > cuda > triton"),
        ((7, 0), False, True, False, 64, "ieee", "triton", "cuda > triton > reference"),
    ],
)
def test_auto_rule_for_float32_on_cuda(monkeypatch, capability, allow_tf32, tf32x3_fits, cuda_kernels, head_dim,
                                       precision, chosen, order):
    """float32: Triton multiplies with TF32 where torch allows it, else tf32x3 from Ampere on up to head dim 128
    where its tiles fit in shared memory, else IEEE FMAs; only in that last case does auto prefer another
    backend: the reference above head dim 64 where its memory fits (here it does), else the cuda kernels
    (measured, see dispatch.auto_preference)."""
    monkeypatch.setattr(dispatch.triton_backend, "_tf32x3_fits", lambda index, block_d: tf32x3_fits)
    monkeypatch.setattr(dispatch, "_gpu_memory_bytes", lambda device: 80 << 30)
    saved = torch.backends.cuda.matmul.allow_tf32  # a module with __setattr__, which monkeypatch cannot undo
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        p = _fake_cuda_problem(monkeypatch, capability=capability, dtype=torch.float32, head_dim=head_dim,
                               cuda_kernels=cuda_kernels)
        assert triton_backend.float32_precision(p.device, p.head_dim) == precision
        d = dispatch.decide(p, "auto")
        assert d.backend == chosen and f"auto rule for cuda tensors: {order}" in d.decided_by, d
        assert (d.fallback is None) == cuda_kernels, d.fallback
        assert (d.note is not None) == (chosen == "reference"), d.note
        _assert_select_agrees(p, d)
        assert triton_backend.float32_precision(torch.device("cpu"), 64) in ("tf32", "ieee")  # interpreter
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize(
    "head_dim, N, segments, chosen",
    [
        (64, 16384, [2048, 4096, 8192, 16384], "triton"),  # tf32x3
        (128, 16384, [2048, 4096, 8192, 16384], "triton"),  # tf32x3 (with the tf32x3-only configs)
        (256, 4096, [512, 1024], "reference"),  # IEEE in Triton; reference estimate 1.25 GiB
        (256, 16384, [2048, 4096, 8192, 16384], "reference"),  # 19 GiB <= 35 GiB
        (256, 65536, [2048, 4096, 8192, 16384], "cuda"),  # 76 GiB > 35 GiB
    ],
)
def test_float32_rule_on_an_h200(monkeypatch, head_dim, N, segments, chosen):
    """The decisions behind the float32 rows of the auto table (benchmarks/README.md, "The auto rule"), with an
    H200's properties (sm 9.0, 227 KiB of shared memory per block, 140 GiB) and its benchmark's shapes (B=1, H=16)."""
    import types

    h200 = types.SimpleNamespace(shared_memory_per_block_optin=232448, total_memory=143771 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: h200)
    triton_backend._tf32x3_fits.cache_clear()
    try:
        _fake_cuda_problem(monkeypatch, capability=(9, 0))  # the kernel table and the capability
        q = torch.empty(1, N, 16, head_dim, dtype=torch.float32, device="meta")
        p = validate(q, q, q, segments, [1, 2, 4, 8][: len(segments)])
        p = dataclasses.replace(p, device=torch.device("cuda", 0))
        assert dispatch.decide(p, "auto").backend == chosen
    finally:
        triton_backend._tf32x3_fits.cache_clear()


def test_auto_runs_the_reference_on_a_gpu_only_within_its_memory_share(monkeypatch):
    """The reference's memory grows with N * w/r per branch: auto takes it for float32 at head_dim > 64 (IEEE
    products in Triton) only while its estimate is at most a quarter of the GPU's memory, and says so."""
    monkeypatch.setattr(dispatch.triton_backend, "_tf32x3_fits", lambda index, block_d: True)
    p = _fake_cuda_problem(monkeypatch, dtype=torch.float32, head_dim=256)
    need = reference_memory_bytes(p)
    # branches (8, 1) and (16, 2) over N=64, 4 heads: 4 * 8 segments of 8 members, 4 * 4 segments of 8 members
    scores, gathered = 4 * 8 * 8 * 8 + 4 * 4 * 8 * 8, 2 * 4 * 65 * 256
    assert need == 4 * (4 * scores + 4 * gathered)  # float32
    monkeypatch.setattr(dispatch, "_gpu_memory_bytes", lambda device: 4 * need)
    d = dispatch.decide(p, "auto")
    assert d.backend == "reference" and "is at most 25% of the GPU's" in d.decided_by, d
    assert d.note == dispatch.REFERENCE_ON_GPU_WARNING and d.fallback is None
    assert f"note: {dispatch.REFERENCE_ON_GPU_WARNING}" in str(d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert dispatch.select(p, "auto").name == "reference"
    assert [str(w.message) for w in caught] == [dispatch.REFERENCE_ON_GPU_WARNING]
    monkeypatch.setattr(dispatch, "_gpu_memory_bytes", lambda device: 4 * need - 1)
    d = dispatch.decide(p, "auto")
    assert d.backend == "cuda" and "cuda > triton > reference" in d.decided_by and d.note is None, d


# --- explicit backends and the environment variable ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_explicit_backend_runs(backend, runs):
    q, k, v = _qkv()
    dilated_attn.dilated_attention(q, k, v, SEGS, DILS, backend=backend)
    assert runs == [backend]


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_a_call_asks_no_other_backend(monkeypatch, runs, backend):
    """A call that names a backend that can run, or whose auto rule's first preference can, does not check (or
    import) the others, its backward neither (decide() asks every backend for its record: host time a decoding step
    does not have); explain() still lists every verdict."""
    q, k, v = _qkv(requires_grad=True)
    if backends.REGISTRY["cpu"].why_not(validate(q, k, v, SEGS, DILS)) is not None:
        pytest.skip("the cpu backend cannot run here (no CPU kernels): auto falls back, asking every backend")

    class Asked(Exception):
        pass

    def asked(name):
        def ask(*args, **kwargs):
            raise Asked(f"the {name} backend was asked")
        return ask

    for name, b in backends.REGISTRY.items():
        if name != "cpu":
            for method in ("why_not", "reasons", "backward_reasons", "unavailable"):
                monkeypatch.setattr(b, method, asked(name))
    monkeypatch.setattr(triton_backend, "load_error", asked("triton"))
    out, lse = dilated_attn.dilated_attention(q, k, v, SEGS, DILS, backend=backend, return_lse=True)
    torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))  # the cpu backward takes the LSE's gradient
    assert runs == ["cpu"]
    with pytest.raises(Asked):
        dilated_attn.explain(q, k, v, SEGS, DILS, backend=backend)


_ABOVE_BACKENDS = ("dispatch", "functional", "nn", "ring", "cli", "integrations", "warmup")


def _imports_above_backends(source: str, package: str) -> list[str]:
    """The modules of dilated_attn above backends/ that `source` (a module of `package`) imports, in any form:
    `import dilated_attn.x`, `from dilated_attn.x import y`, `from ..x import y`, `from .. import x`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            stem = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(stem + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[:2] in (["dilated_attn", a] for a in _ABOVE_BACKENDS)]
    return found


def test_backends_import_nothing_above_them():
    """backends/ is below dispatch: none of its modules imports the dispatch layer or anything that uses it
    (the LSE-gradient backward is chosen by dispatch and handed down: backends.autograd.set_lse_gradient_chooser)."""
    import pathlib

    root = pathlib.Path(dilated_attn.__file__).parent
    files = sorted((root / "backends").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        package = ".".join(("dilated_attn", *path.relative_to(root).parent.parts))
        assert _imports_above_backends(path.read_text(), package) == [], path.relative_to(root)
    # the check sees each form of such an import
    for line in ("from ..dispatch import decide", "from .. import dispatch", "from ...ring import plan",
                 "import dilated_attn.functional", "from dilated_attn.nn import DilatedAttention"):
        assert _imports_above_backends(line, "dilated_attn.backends.cudnn" if "..." in line
                                       else "dilated_attn.backends"), line
    assert _imports_above_backends("from ..spec import Problem\nfrom . import dispatch_table",
                                   "dilated_attn.backends") == []


def test_explicit_backend_that_cannot_run_lists_every_verdict(no_cpu_kernels, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would let triton run CPU tensors
    q, k, v = _qkv()
    with pytest.raises(ValueError) as info:
        dilated_attn.dilated_attention(q, k, v, SEGS, DILS, backend="cpu")
    message = str(info.value)
    assert message.startswith("backend='cpu' cannot run this input: dilated_attn._C was built without CPU kernels")
    assert "Backends that can: reference" in message
    for name, why in backends.verdicts(validate(q, k, v, SEGS, DILS)).items():
        assert f"{name}: {why or 'can run'}" in message


def test_env_var_forces_a_backend_and_the_argument_wins(monkeypatch, runs):
    q, k, v = _qkv()
    monkeypatch.setenv("DILATED_ATTN_BACKEND", "reference")
    out = dilated_attn.dilated_attention(q, k, v, SEGS, DILS)
    assert runs == ["reference"] and torch.equal(out, dilated_attention_reference(q, k, v, SEGS, DILS)[0])
    d = dilated_attn.explain(q, k, v, SEGS, DILS)
    assert d.backend == "reference" and "DILATED_ATTN_BACKEND='reference'" in d.decided_by
    dilated_attn.dilated_attention(q, k, v, SEGS, DILS, backend="cpu")  # an explicit argument wins
    assert runs == ["reference", "cpu"]
    for unset in ("", "auto"):
        monkeypatch.setenv("DILATED_ATTN_BACKEND", unset)
        dilated_attn.dilated_attention(q, k, v, SEGS, DILS)
    assert runs == ["reference", "cpu", "cpu", "cpu"]


def test_env_var_errors(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("DILATED_ATTN_BACKEND", "fastest")
    with pytest.raises(ValueError, match="environment variable DILATED_ATTN_BACKEND must be .* got 'fastest'"):
        dilated_attn.dilated_attention(q, k, v, SEGS, DILS)
    dilated_attn.dilated_attention(q, k, v, SEGS, DILS, backend="cpu")  # not read when the argument decides
    monkeypatch.setenv("DILATED_ATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DILATED_ATTN_BACKEND='cuda' cannot run this input: needs CUDA tensors"):
        dilated_attn.dilated_attention(q, k, v, SEGS, DILS)


# --- explain --------------------------------------------------------------------------------------------------


def test_explain_names_itself_for_an_unknown_keyword():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"explain\(\) got unexpected keyword arguments \['foo'\]"):
        dilated_attn.explain(q, k, v, SEGS, DILS, foo=1)


def test_explain_reports_without_running(runs):
    q, k, v = _qkv()
    d = dilated_attn.explain(q, k, v, SEGS, DILS, causal=True, return_lse=True)
    assert runs == []
    assert d.backend == "cpu" and d.fallback is None and d.error is None
    assert d.verdicts == backends.verdicts(validate(q, k, v, SEGS, DILS))
    table = str(d)
    assert "cpu        can run  <- runs" in table and "decided by: the auto rule for cpu tensors" in table
    for name, why in d.verdicts.items():
        assert f"{name:<9}  {why or 'can run'}" in table
    assert "B=2 N=37 Hq=4 Hkv=2 D=8 float32 on cpu; branches (8, 1), (16, 2); causal=True" in table


def test_explain_reports_the_forward_and_backward_pair(monkeypatch):
    """explain() names the forward's backend and the backward's, where the LSE has a gradient or not, and says why
    a backward is another backend's."""
    q, k, v = _qkv()
    d = dilated_attn.explain(q, k, v, SEGS, DILS)
    assert (d.backend, d.backward, d.lse_gradient_backward) == ("cpu", "cpu", "cpu")
    assert "  forward: cpu, backward: cpu (also where the LSE has a gradient)\n" in str(d)
    for b in (backends.CUDNN, backends.TRITON):
        monkeypatch.setattr(b, "unavailable", lambda: None)
    p = _fake_cuda_problem(monkeypatch)
    d = dispatch.decide(p, "cudnn")
    lse_rule, nondeterminism_rule = backends.CUDNN.backward_op.lse_gradient_rule, backends.CUDNN.backward_op.nondeterminism_rule
    assert (d.backend, d.backward, d.lse_gradient_backward) == ("cudnn", "cudnn", "triton")
    assert f"  forward: cudnn, backward: cudnn; where the LSE has a gradient: triton ({lse_rule})\n" in str(d)
    monkeypatch.setattr(dispatch, "_deterministic_algorithms", lambda: True)
    d = dispatch.decide(p, "cudnn")
    assert (d.backend, d.backward, d.lse_gradient_backward) == ("cudnn", "triton", "triton")
    assert (f"  forward: cudnn, backward: triton ({nondeterminism_rule}); where the LSE has a gradient: triton "
            f"({lse_rule}; {nondeterminism_rule})\n") in str(d)


def test_explain_an_explicit_backend_that_cannot_run(no_cpu_kernels):
    q, k, v = _qkv()
    d, warned = _recorded(lambda: dilated_attn.explain(q, k, v, SEGS, DILS, backend="cpu"))
    assert d.backend is None and d.error.startswith("backend='cpu' cannot run") and warned == []
    assert "none (dilated_attention raises ValueError)" in str(d)
    d = dilated_attn.explain(q, k, v, SEGS, DILS)
    assert d.backend == "reference" and "cpu cannot (dilated_attn._C was built without CPU kernels)" in d.fallback
    with pytest.raises(ValueError, match="segment_lengths"):
        dilated_attn.explain(q, k, v, [], [])


# --- torch.compile ---------------------------------------------------------------------------------------------


def _graph_capturing_compile(fn):
    """torch.compile(fn, fullgraph=True) with a backend that keeps dynamo's graph (and runs it as it is)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def _attend(q, k, v):
    return dilated_attn.dilated_attention(q, k, v, SEGS, DILS, causal=True)


@pytest.mark.parametrize("env", [None, "reference"])
def test_compile_fullgraph_follows_the_env_var(env, monkeypatch):
    if env is not None:
        monkeypatch.setenv("DILATED_ATTN_BACKEND", env)
    q, k, v = _qkv()
    compiled, graphs = _graph_capturing_compile(_attend)
    torch.testing.assert_close(compiled(q, k, v), _attend(q, k, v), rtol=0, atol=0)
    assert len(graphs) == 1
    assert ("dilated_attn.forward" in graphs[0]) == (env is None)  # the compiled CPU op, or the reference's ops


def test_compile_fullgraph_warns_once_when_auto_falls_back(no_cpu_kernels):
    q, k, v = _qkv()
    compiled, graphs = _graph_capturing_compile(_attend)
    (out, warned) = _recorded(lambda: compiled(q, k, v))
    assert len(graphs) == 1 and "dilated_attn.forward" not in graphs[0]
    assert len(warned) == 1 and "without CPU kernels" in warned[0]
    torch.testing.assert_close(out, dilated_attention_reference(q, k, v, SEGS, DILS, causal=True)[0])
    _, warned = _recorded(lambda: (compiled(q, k, v), _attend(q, k, v)))
    assert warned == []


def _compiled_matches_eager(device, dtype, tol, D=16):
    q, k, v = _qkv(B=2, N=70, Hq=6, Hkv=2, D=D, dtype=dtype, device=device, requires_grad=True)

    def f(q, k, v):
        out, lse = dilated_attn.dilated_attention(q, k, v, [16, 32, 64], [1, 2, 4], causal=True, return_lse=True)
        return out * 2, lse

    compiled = torch.compile(f, fullgraph=True)
    (out, lse), (out_e, lse_e) = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, out_e, **tol)
    torch.testing.assert_close(lse, lse_e, **tol)
    go = torch.randn_like(out)
    gl = torch.randn_like(lse)
    grads = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (q, k, v))
    grads_e = torch.autograd.grad((out_e * go).sum() + (lse_e * gl).sum(), (q, k, v))
    for a, b in zip(grads, grads_e):
        torch.testing.assert_close(a, b, **tol)


def test_compile_fullgraph_forward_backward_matches_eager_cpu():
    _compiled_matches_eager("cpu", torch.float32, dict(rtol=0, atol=0))


def test_reference_rule_traces_without_graph_break(monkeypatch):
    """reference_preferred (memory estimate, device memory, the reason's text) runs inside a traced graph."""
    monkeypatch.setattr(dispatch.triton_backend, "_tf32x3_fits", lambda index, block_d: True)
    monkeypatch.setattr(dispatch, "_gpu_memory_bytes", lambda device: 80 << 30)
    p = _fake_cuda_problem(monkeypatch, dtype=torch.float32, head_dim=256)

    def f(x):
        return x + len(dispatch.reference_preferred(p))

    compiled, graphs = _graph_capturing_compile(f)
    x = torch.zeros(3)
    assert torch.equal(compiled(x), f(x)) and len(graphs) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 16), (torch.float32, 16), (torch.float32, 256)])
def test_compile_fullgraph_forward_backward_matches_eager_gpu(dtype, head_dim):
    # float32 at head dim 256: auto runs the reference on a GPU with memory to spare (dispatch.reference_preferred)
    q = torch.empty(2, 70, 6, head_dim, dtype=dtype, device="cuda")
    expected = "reference" if head_dim > 128 and dtype == torch.float32 else "triton"
    assert dilated_attn.explain(q, q[:, :, :2], q[:, :, :2], [16, 32, 64], [1, 2, 4]).backend == expected
    # Under torch.compile the scale reaches the kernels as a float64 scalar: a few low bits may differ.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    _compiled_matches_eager("cuda", dtype, tol, D=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal, head_groups", [(128, False, "all"), (256, True, "split")])
def test_gpu_reference_memory_estimate_bounds_its_peak(head_dim, causal, head_groups):
    """auto's memory rule rests on backends.reference.memory_bytes: an upper bound on the reference's peak for a
    forward and backward, and not a loose one (the measured peak is at least a quarter of it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 3000, 8, head_dim, device="cuda", generator=g, requires_grad=True)
    k, v = (torch.randn(2, 3000, 4, head_dim, device="cuda", generator=g, requires_grad=True) for _ in range(2))
    args = ([512, 1024, 2048, 4096], [1, 2, 4, 8])
    kwargs = dict(causal=causal, head_groups=head_groups, backend="reference")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = dilated_attn.dilated_attention(q, k, v, *args, **kwargs)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    estimate = reference_memory_bytes(validate(q, k, v, *args, causal=causal, head_groups=head_groups))
    assert estimate / 4 <= peak <= estimate, (peak, estimate)
