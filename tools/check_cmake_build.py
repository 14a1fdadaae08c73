"""Runs the package on the extension that CMakeLists.txt built, to show that it is setup.py's extension:

    python tools/check_cmake_build.py build/cmake/_C.<abi>.so [dilated-attn check arguments]

loads that library as dilated_attn._C (in place of the installed package's own), prints its build_info, and runs
`dilated-attn check` on it (every backend of the device against the float64 reference; exit status 1 on any
mismatch). CI runs it on the CPU configuration.
"""

import importlib.util
import sys

import torch  # noqa: F401 - the library links against torch's, which this loads first


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    spec = importlib.util.spec_from_file_location("dilated_attn._C", sys.argv[1])
    library = importlib.util.module_from_spec(spec)
    sys.modules["dilated_attn._C"] = library  # the package's `from .. import _C` takes this one
    spec.loader.exec_module(library)

    import dilated_attn
    from dilated_attn.backends import extension
    from dilated_attn.cli import main as cli

    info = dilated_attn.build_info()
    print(f"{library.__file__}: {info}")
    if extension._C is not library or not info.get("loaded"):
        print("the package did not load this library", file=sys.stderr)
        return 1
    return cli(["check", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
