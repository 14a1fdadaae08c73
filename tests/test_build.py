"""The compiled extension is built, loaded and registered (a broken build must fail here, not skip)."""

import torch

import dilated_attn
from dilated_attn.backends import extension


def test_extension_is_loaded():
    info = dilated_attn.build_info()
    assert info["loaded"], info.get("error")
    assert info["torch_version"].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert isinstance(info["with_cuda"], bool)


def test_ops_are_registered_with_a_cpu_kernel():
    assert extension.has_kernel("cpu")
    schema = str(torch.ops.dilated_attn.forward.default._schema)
    assert "int[] segment_lengths" in schema and "-> (Tensor out, Tensor lse)" in schema
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attn::backward", "CPU")


def _arguments(schema) -> list[tuple]:
    """(name, type, default) of each argument of an op schema (SymInt read as int: Python ops infer SymInt)."""
    return [(a.name, str(a.type).replace("SymInt", "int"), a.default_value) for a in schema.arguments]


def _declared(signature) -> list[tuple]:
    def op():
        pass

    op.__signature__ = signature
    return _arguments(torch._C.parse_schema("dilated_attn::op" + torch.library.infer_schema(op, mutates_args=())))


def test_every_attention_op_takes_the_one_signature():
    """backends/signature.py is the ops' signature: the compiled ops' C++ declarations (csrc/registration.cpp)
    match it argument by argument, as does every registered backend op (the packed ones with cu_seqlens and
    max_seqlen first in the configuration)."""
    from dilated_attn.backends import REGISTRY, signature

    for backend in REGISTRY.values():
        backend.unavailable()  # imports the backend's ops where it can run here

    want = {(kind, packed): _declared(getattr(signature, f"{kind}_signature")(packed))
            for kind in ("forward", "backward") for packed in (False, True)}
    assert [a[0] for a in want[("forward", False)][:4]] == ["q", "k", "v", "segment_lengths"]
    assert [a[0] for a in want[("backward", True)][7:9]] == ["cu_seqlens", "max_seqlen"]
    ops = [("forward", False, "forward"), ("backward", False, "backward")] + [
        (kind, "varlen" in name, name) for name in ("cudnn", "triton", "triton_varlen", "fa4", "fa4_varlen")
        for kind in ("forward", "backward")
        for name in [f"{name}_{kind}"]]
    checked = 0
    for kind, packed, name in ops:
        if not hasattr(torch.ops.dilated_attn, name):  # a backend that cannot run here (cudnn, fa4 without a GPU)
            continue
        assert _arguments(getattr(torch.ops.dilated_attn, name).default._schema) == want[(kind, packed)], name
        checked += 1
    assert checked >= 2  # the compiled ops at least


def test_a_cpu_only_build_has_no_cuda_kernel():
    if not dilated_attn.build_info()["with_cuda"]:
        assert not extension.has_kernel("cuda")


def test_package_is_typed_and_licensed():
    """The type hints reach type checkers (py.typed is installed), and the license file matches pyproject's."""
    import importlib.resources
    import os

    assert importlib.resources.files("dilated_attn").joinpath("py.typed").is_file()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert 'license = { text = "MIT" }' in f.read()


def test_one_version_number():
    """The version is written once, in dilated_attn/__init__.py: pyproject.toml reads it from there, and the
    installed package's metadata agrees."""
    import importlib.metadata
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version\s*=\s*"', pyproject, re.M) is None and 'dynamic = ["version"]' in pyproject
    assert importlib.metadata.version("dilated_attn") == dilated_attn.__version__


def test_a_tile_table_this_build_lacks_is_refused_before_the_launch():
    """DILATED_ATTN_CUDA_TILES asks for a tile table by hand: the cuda backend refuses one whose code the build does
    not hold for the GPU (extension.tile_table_refusal, the launcher's own rule), so that the call raises its
    ValueError; Pascal's tables run on newer GPUs only in a DILATED_ATTN_PASCAL_PROXY=1 build."""
    refusal = extension.tile_table_refusal
    for requested in ("pascal", "gp100"):
        assert "no code of that tile table for compute capability 9.x" in refusal(requested, (9, 0), False)
        assert refusal(requested, (9, 0), True) is None  # the proxy build
        assert refusal(requested, (6, 1), False) is None
    assert "capability 6.x" in refusal("volta", (6, 0), True)
    assert refusal("volta", (7, 0), False) is None
    for left_to_the_launcher in ("", "61", "Pascal"):
        assert refusal(left_to_the_launcher, (9, 0), False) is None
