"""The fa4 backend's direct programs (direct.py) kept on disk, so that a new process runs them without importing
FlashAttention-4.

Importing FlashAttention-4 (its CuTe DSL, MLIR's Python bindings) takes 7-9 s on an H200 machine's host, and was most
of a new process's wait for its first result. Its kernels need none of it once compiled: FlashAttention-4 exports each
kernel it compiles to its disk cache as an object file with a TVM-FFI entry point (`__tvm_ffi_func`), whose host code
loads the kernel's cubin itself. So when a shape's first call is watched (direct.py), its program is written here as
JSON (the tensors it makes, the kernels in order with their arguments, which of the call's tensors go where), and each
kernel's object file is linked (`cc -shared`, 30 ms) into a shared library beside it, against the two runtime
libraries it calls (the CuTe DSL's and TVM-FFI's). A later process with the same versions on the same kind of GPU
finds the program by its key, loads the libraries with `tvm_ffi` (0.1 s to import, milliseconds a library) and runs
the same kernels with the same arguments: the first call of a stored shape takes milliseconds, not seconds.

A program is stored under a digest of the versions of flash-attn-4, the CuTe DSL and TVM-FFI, the Python version and
FlashAttention's interface file (so that another install is never served another's programs), then by its call's key
and the GPU (name, compute capability, multiprocessors: a kernel's grid may depend on them). Where anything is missing
(no C compiler, FlashAttention-4's disk cache off, an argument JSON cannot hold) the program is not stored and its
shape imports FlashAttention-4 in each new process, as before; `store_problem()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

__all__ = ["directory", "has_programs", "load", "save", "store_problem"]

FORMAT = 1  # of the JSON below; a change makes a new directory
_DISTRIBUTIONS = ("flash-attn-4", "nvidia-cutlass-dsl", "apache-tvm-ffi")
_problem: Optional[str] = None  # why the last program could not be stored
_lock = threading.Lock()
_libraries: dict[str, object] = {}  # path -> its kernel's tvm_ffi function, loaded once a process


def _fingerprint() -> Optional[str]:
    """A digest of what the stored kernels and programs depend on, or None where flash-attn-4 is not installed."""
    from importlib import metadata, util

    try:
        versions = [metadata.version(name) for name in _DISTRIBUTIONS]
    except metadata.PackageNotFoundError:
        return None
    try:  # finds flash_attn.cute without running it (its parent is a namespace package)
        spec = util.find_spec("flash_attn.cute")
        status = (Path(next(iter(spec.submodule_search_locations))) / "interface.py").stat()
    except (ImportError, AttributeError, TypeError, StopIteration, OSError):
        return None
    seed = repr((FORMAT, versions, sys.version_info[:2], status.st_size, status.st_mtime_ns))
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def directory() -> Optional[Path]:
    """Where this install's programs are kept (backends.fa4.cache_dir()/programs/<digest>), or None where
    flash-attn-4 is not installed. Looked up once a process (the package versions do not change under it)."""
    from . import cache_dir

    digest = _fingerprint()
    return None if digest is None else Path(cache_dir()) / "programs" / digest


def has_programs() -> bool:
    """Whether any program is stored for this install (a process that finds one imports FlashAttention-4 only when a
    shape misses)."""
    where = directory()
    return where is not None and where.is_dir() and any(where.glob("*.json"))


def store_problem() -> Optional[str]:
    """Why the last program this process tried to store was not stored (None where it was, or none was tried)."""
    return _problem


def _device(device: torch.device) -> tuple:
    if device.type != "cuda":  # the tests' stand-in kernels
        return (device.type,)
    p = torch.cuda.get_device_properties(device)
    return p.name, p.major, p.minor, p.multi_processor_count


def _name(kind: str, key: tuple, device: torch.device) -> tuple[str, str]:
    """(the file name of a program, the text it is keyed by): repr is exact for the key's floats and names its
    dtypes and sizes the same in every process."""
    text = repr((kind, key, _device(device)))
    return hashlib.sha256(text.encode()).hexdigest()[:32] + ".json", text


def _encode(value):
    """A kernel argument as JSON: tuples (FlashAttention's named tuples too) as lists."""
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} argument")


def _decode(value):
    return tuple(_decode(v) for v in value) if isinstance(value, list) else value


def _runtime_libraries() -> list[str]:
    """The shared libraries an exported kernel calls into (the CuTe DSL's runtime, TVM-FFI's), asked of the CuTe DSL
    that compiled it (imported in this process)."""
    from cutlass import cute

    return [path for path in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(path)]


def _link(obj: str, where: Path) -> str:
    """The shared library of the kernel object file `obj`, linked into `where` once (its name is the object's, which
    FlashAttention names by the kernel's compile key)."""
    target = where / (Path(obj).stem + ".so")
    if target.exists():
        return target.name
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler to link the kernels with (cc, gcc or $CC)")
    libraries = _runtime_libraries()
    rpaths = [f"-Wl,-rpath,{os.path.dirname(path)}" for path in libraries]
    partial = where / f".{target.name}.{os.getpid()}.tmp"
    done = subprocess.run([*shlex.split(compiler), "-shared", "-o", str(partial), obj, *libraries, *rpaths],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"linking {obj} failed: {done.stderr.strip()[-500:]}")
    os.replace(partial, target)  # whole or absent, for a process loading it meanwhile
    return target.name


def save(kind: str, key: tuple, device: torch.device, made: tuple, steps: tuple, result: tuple,
         objects: tuple) -> bool:
    """Keeps a program (direct._Program's fields; `objects`: each kernel step's object file in FlashAttention-4's
    disk cache, or None where it has none) for later processes. False where it cannot be (store_problem() says why)."""
    global _problem
    where = directory()
    try:
        if where is None:
            raise RuntimeError("flash-attn-4's version is unknown")
        if any(obj is None for obj in objects):
            raise RuntimeError("a kernel has no object file in FlashAttention-4's disk cache (is "
                               "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED off?)")
        where.mkdir(parents=True, exist_ok=True)
        name, text = _name(kind, key, device)
        with _lock:
            libraries = iter([_link(obj, where) for obj in objects])
        encoded = []
        for step in steps:
            if step[0] == "kernel":
                _, _, template, slots = step
                encoded.append(["kernel", next(libraries), _encode(template), [list(s) for s in slots]])
            else:
                encoded.append([step[0], step[1], *map(_encode, step[2:])])
        record = dict(format=FORMAT, key=text, steps=encoded, result=[None if r is None else list(r) for r in result],
                      made=[[list(shape), list(stride), str(dtype).removeprefix("torch.")]
                            for shape, stride, dtype, _ in made])
        partial = where / f".{name}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(record))
        os.replace(partial, where / name)
    except (OSError, RuntimeError, TypeError, ValueError, subprocess.SubprocessError, ImportError) as exc:
        _problem = f"{type(exc).__name__}: {exc}"
        return False
    _problem = None
    return True


def _kernel(path: Path):
    with _lock:
        function = _libraries.get(str(path))
        if function is None:
            import tvm_ffi

            function = _libraries[str(path)] = tvm_ffi.load_module(str(path))["func"]
    return function


def load(kind: str, key: tuple, device: torch.device) -> Optional[tuple]:
    """A stored program of `key` on `device`: (made, steps, result) as direct._Program takes them, its kernels loaded;
    None where none is stored (or it cannot be read: the call then goes through FlashAttention-4)."""
    where = directory()
    if where is None:
        return None
    name, text = _name(kind, key, device)
    path = where / name
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT or record.get("key") != text:
            return None
        steps = []
        for step in record["steps"]:
            if step[0] == "kernel":
                steps.append(("kernel", _kernel(where / step[1]), _decode(step[2]),
                              tuple(tuple(s) for s in step[3])))
            else:
                steps.append((step[0], step[1], *map(_decode, step[2:])))
        made = tuple((tuple(shape), tuple(stride), getattr(torch, dtype), device)
                     for shape, stride, dtype in record["made"])
        result = tuple(None if r is None else tuple(r) for r in record["result"])
    except Exception:  # noqa: BLE001 - a damaged or foreign file is a miss: the interface runs and stores it anew
        return None
    return made, tuple(steps), result
