"""Compiles one CUDA source to PTX with NVRTC (ctypes, no toolkit install): the compile check's front end for the
architectures the installed nvcc no longer has (tools/check_cuda_kernels.sh: CUDA 12's NVRTC for Pascal).

    python tools/nvrtc_ptx.py LIBNVRTC SOURCE OUT.ptx [NVRTC OPTIONS...]

Exits non-zero with NVRTC's log on a compile error; prints the log's warnings otherwise.
"""

import ctypes
import sys


def main() -> None:
    lib_path, source, out, *options = sys.argv[1:]
    nvrtc = ctypes.CDLL(lib_path)
    program = ctypes.c_void_p()
    with open(source, "rb") as f:
        text = f.read()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), text, source.encode(), 0, None, None) != 0:
        sys.exit(f"nvrtcCreateProgram failed for {source}")
    args = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    status = nvrtc.nvrtcCompileProgram(program, len(options), args)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    # NVRTC 12 warns that pre-sm_75 targets are deprecated: true, and the reason this check exists
    lines = [line for line in log.value.decode().splitlines() if line and "are deprecated" not in line]
    if lines:
        print("\n".join(lines), file=sys.stderr)
    if status != 0:
        sys.exit(f"NVRTC failed to compile {source} ({' '.join(options)})")
    nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(program, ptx)
    with open(out, "w") as f:
        f.write(ptx.value.decode())


if __name__ == "__main__":
    main()
