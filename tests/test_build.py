"""The compiled extension is built, loaded and registered (a broken build must fail here, not skip)."""

import torch

import dilated_attn
from dilated_attn.backends import compiled


def test_extension_is_loaded():
    info = dilated_attn.build_info()
    assert info["loaded"], info.get("error")
    assert info["torch_version"].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert isinstance(info["with_cuda"], bool)


def test_ops_are_registered_with_a_cpu_kernel():
    assert compiled.has_kernel("cpu")
    schema = str(torch.ops.dilated_attn.forward.default._schema)
    assert "int[] segment_lengths" in schema and "-> (Tensor out, Tensor lse)" in schema
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attn::backward", "CPU")


def test_a_cpu_only_build_has_no_cuda_kernel():
    if not dilated_attn.build_info()["with_cuda"]:
        assert not compiled.has_kernel("cuda")


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
