"""FlashAttention-4's kernels called without its Python interface's per-call work.

`flash_attn.cute.interface` spends most of a call's host time on what is the same for every call of one shape: it
checks the inputs, chooses tiles and schedulers, builds keys of some sixty entries and looks up the compiled kernels,
allocates its workspace, then calls the kernels (a backward runs three to five). A LongNet forward at N = 65536
makes about ten such calls, 1.4-3.3 ms of host time on an H100's and an H200's hosts: where the GPU finishes them
faster (a causal forward, 2.1-2.3 ms), the host bounds the call.

So the first call of each shape and layout goes through the interface, watched: the kernels it runs (through its
compile caches, each kernel with its arguments), the tensors it makes (and what it fills them with) and every other
tensor operation it does, in order. Later calls of that shape and layout repeat that program with their own tensors:
the same kernels, the same other arguments, fresh tensors where the interface made them. A call is repeated only
where its program is plainly that of these tensors: every tensor a kernel takes is one of the call's own (the same
memory, shape and strides) or one the interface made, every other argument a plain value (numbers, None, tuples of
them), and the interface did nothing else to a tensor (no copy of an input, no write into one). Anything else (a call
that copies an input first, another version's interface) leaves that shape on the interface. A program is keyed by
the call's other arguments and its tensors' shapes, strides, dtypes, 16-byte alignment and which of them share
memory, so it is repeated only on tensors laid out as the watched call's. Only flash-attn-4 versions whose programs
the GPU tests have compared with the interface's results are called directly (`VERIFIED_VERSIONS`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...compile_hints import warn_once
from . import stored

__all__ = ["DIRECT_ENV", "ENABLED", "VERIFIED_VERSIONS", "Deferred", "Direct", "backward", "forward", "path", "version_of",
           "check_interface"]

# DILATED_ATTN_FA4_DIRECT=0 runs every call through FlashAttention-4's interface: the same kernels with its host time
# per call, should a flash-attn-4 release misbehave under the direct calls (benchmarks/bench_gpu.py's `fa4_interface`
# provider sets ENABLED to measure what they save).
DIRECT_ENV = "DILATED_ATTN_FA4_DIRECT"
ENABLED = os.environ.get(DIRECT_ENV, "1") != "0"
VERIFIED_VERSIONS = ("4.0.0b36",)
# The most programs kept per function; then they are dropped and noted anew (packs of ever new lengths would grow them
# without end)
MAX_PROGRAMS = 1024

aten = torch.ops.aten
_FACTORIES = {aten.empty, aten.empty_like, aten.empty_strided, aten.zeros, aten.zeros_like, aten.new_empty,
              aten.new_zeros, aten.new_empty_strided}
_FILLS = {aten.zero_, aten.fill_}
_VIEWS = {aten.detach, aten.alias, aten.view, aten.transpose, aten.permute, aten.t, aten.unsqueeze, aten.squeeze,
          aten.select, aten.slice, aten.as_strided}


def _same(a: torch.Tensor, b: Optional[torch.Tensor]) -> bool:
    return (b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _plain(x) -> bool:
    """Whether `x` means the same for every call: no tensor, nothing mutable but tuples of values."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return True
    return isinstance(x, tuple) and all(_plain(y) for y in x)


class _Watch(TorchDispatchMode):
    """One interface call's tensor operations, onto `steps` in order: each tensor it makes (`("make", tensor)`), each
    fill of such a tensor (`("fill", tensor, value)`); the first other operation that is not a view, in `other`."""

    def __init__(self, steps: list):
        super().__init__()
        self.steps = steps
        self.other: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _FACTORIES:
            self.steps.append(("make", result))
            if packet in (aten.zeros, aten.zeros_like, aten.new_zeros):
                self.steps.append(("fill", result, 0))
        elif packet in _FILLS and any(s[0] == "make" and _same(s[1], args[0]) for s in self.steps):
            self.steps.append(("fill", args[0], 0 if packet is aten.zero_ else args[1]))
        elif packet not in _VIEWS and self.other is None:
            self.other = str(func)
        return result


class _NotingCache:
    """A compile cache of the interface during one watched call: looked up as the cache is, each kernel the watched
    thread runs noted onto `steps` (`("kernel", kernel, args, object file)`: the file FlashAttention-4's disk cache
    keeps it in, or None), each kernel compiled counted in `compiled`."""

    def __init__(self, cache, steps: list, thread: int, compiled: list):
        self.cache, self.steps, self.thread, self.compiled = cache, steps, thread, compiled

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, kernel) -> None:
        self.compiled.append(key)
        self.cache[key] = kernel

    def __getitem__(self, key):
        kernel = self.cache[key]
        if threading.get_ident() != self.thread:
            return kernel

        def noted(*args):
            self.steps.append(("kernel", kernel, args, self._object_file(key)))
            with _disable_current_modes():  # the kernel's own work is not the interface's
                return kernel(*args)

        return noted

    def _object_file(self, key) -> Optional[str]:
        """Where FlashAttention-4's disk cache (cache_utils.JITPersistentCache) exported this kernel, or None."""
        folder, digest = getattr(self.cache, "cache_path", None), getattr(self.cache, "_key_to_hash", None)
        if folder is None or not callable(digest):
            return None
        path = os.path.join(str(folder), f"{digest(key)}.o")
        return path if os.path.isfile(path) else None

    def __getattr__(self, name):
        return getattr(self.cache, name)


@dataclass(frozen=True)
class _Program:
    """What one interface call did, to repeat with other tensors of its shapes: `made` (shape, strides, dtype,
    device) of each tensor it makes; `steps` in order, `("make", i)`, `("fill", i, value)` or `("kernel", kernel,
    template, slots)` where `slots` puts given (0) or made (1) tensor `index` at each tensor position of the
    template; `result`, each returned element's (0 or 1, index), or None; `objects`, each kernel's object file in
    FlashAttention-4's disk cache (or None), for stored.py."""

    made: tuple
    steps: tuple
    result: tuple
    objects: tuple = ()

    def __call__(self, given: tuple):
        made: list = [None] * len(self.made)
        sources = (given, made)
        for step in self.steps:
            if step[0] == "kernel":
                _, kernel, template, slots = step
                args = list(template)
                for position, kind, index in slots:
                    args[position] = sources[kind][index]
                kernel(*args)
            elif step[0] == "make":
                shape, stride, dtype, device = self.made[step[1]]
                made[step[1]] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                made[step[1]].fill_(step[2])
        return tuple(None if r is None else sources[r[0]][r[1]] for r in self.result)


def _program(steps: list, given: tuple, result) -> tuple[Optional[_Program], str]:
    """The program of a watched call's steps, or None and why it cannot be repeated."""
    made, program, objects = [], [], []

    def source(t: torch.Tensor):
        for i, g in enumerate(given):
            if _same(t, g):
                return 0, i
        for i, m in enumerate(made):
            if _same(t, m):
                return 1, i
        return None

    for step in steps:
        if step[0] == "make":
            made.append(step[1])
            program.append(("make", len(made) - 1))
        elif step[0] == "fill":
            index = next(i for i, m in enumerate(made) if _same(step[1], m))
            if not _plain(step[2]):
                return None, "a fill with a tensor"
            program.append(("fill", index, step[2]))
        else:
            _, kernel, args, obj = step
            objects.append(obj)
            template, slots = list(args), []
            for position, arg in enumerate(args):
                if isinstance(arg, torch.Tensor):
                    found = source(arg)
                    if found is None:
                        return None, f"kernel argument {position} is neither a given tensor nor one it made"
                    slots.append((position, *found))
                    template[position] = None
                elif not _plain(arg):
                    return None, f"kernel argument {position} is a {type(arg).__name__}"
            program.append(("kernel", kernel, tuple(template), tuple(slots)))
    if not any(step[0] == "kernel" for step in program):
        return None, "no kernel ran"
    returned = []
    for r in result if isinstance(result, tuple) else (result,):
        found = source(r) if isinstance(r, torch.Tensor) else None
        if r is not None and found is None:
            return None, "it returned a tensor it did not make"
        returned.append(found)
    specs = tuple((tuple(m.shape), tuple(m.stride()), m.dtype, m.device) for m in made)
    return _Program(specs, tuple(program), tuple(returned), tuple(objects)), ""


_WATCHING = threading.Lock()


def _watched(interface, given: tuple, run: Callable[[], object]):
    """run() (an interface call on the `given` tensors) watched: (its result, its program or None, why not, how many
    kernels it compiled)."""
    steps: list = []
    compiled: list = []
    thread = threading.get_ident()
    functions = [f for f in vars(interface).values() if callable(f) and hasattr(f, "compile_cache")]
    with _WATCHING:
        caches = [f.compile_cache for f in functions]
        watch = _Watch(steps)
        try:
            for f, cache in zip(functions, caches):
                f.compile_cache = _NotingCache(cache, steps, thread, compiled)
            with watch:
                result = run()
        finally:
            for f, cache in zip(functions, caches):
                f.compile_cache = cache
    if watch.other is not None:
        return result, None, f"it ran {watch.other}", len(compiled)
    program, why = _program(steps, given, result)
    return result, program, why, len(compiled)


def _signature(tensors: tuple) -> tuple:
    """The layouts of the given tensors, and which are the same memory as one before them (a program repeats its
    tensors' roles: k given as v stays so)."""
    pointers = [None if t is None else t.data_ptr() for t in tensors]
    layouts = tuple(None if t is None else (t.shape, t.stride(), t.dtype, p % 16 == 0)
                    for t, p in zip(tensors, pointers))
    return layouts, tuple(pointers.index(p) for p in pointers)


class Direct:
    """One interface function called directly where it can be: `call(given, key, run)` runs the program noted for
    `key` and the given tensors' layouts on `given`, else the one stored on disk by an earlier process (stored.py),
    else run() (the interface on `given`), noting its program and storing it."""

    def __init__(self, kind: str):
        self.kind = kind  # "forward" or "backward": the stored programs' names
        self.programs: dict = {}  # key -> _Program, or None where the interface must run
        self.why_not: dict = {}  # key -> why its calls go through the interface
        self.hits = 0  # calls made directly
        self.loaded = 0  # programs loaded from disk

    def call(self, interface, given: tuple, key: tuple, run: Callable[[], object]):
        if not (ENABLED and _verified(interface)):  # the interface: path() says why (ENABLED first: _verified caches)
            return run()
        device = given[0].device
        key = (key, _signature(given))
        program = self.programs.get((key, device))
        if program is not None:
            self.hits += 1
            return program(given)
        if (key, device) in self.programs:
            return run()
        if isinstance(interface, Deferred):  # the real package, not a test's stand-in
            found = stored.load(self.kind, key, device)
            if found is not None:
                self._keep((key, device), _Program(*found))
                self.loaded += 1
                return self.programs[(key, device)](given)
            module = interface.get()
        else:
            module = interface
        began = time.perf_counter()
        result, program, why, compiled = _watched(module, given, run)
        self._keep((key, device), program)
        if program is None:
            self.why_not[(key, device)] = why
        elif isinstance(interface, Deferred):
            stored.save(self.kind, key, device, program.made, program.steps, program.result, program.objects)
            _say_first(interface, compiled, time.perf_counter() - began)
        return result

    def _keep(self, key: tuple, program: Optional[_Program]) -> None:
        if len(self.programs) >= MAX_PROGRAMS:
            self.programs.clear()
            self.why_not.clear()
        self.programs[key] = program


def _say_first(interface: "Deferred", compiled: int, seconds: float) -> None:
    """Says once a process, in one line, that a call waited for FlashAttention-4 (its import, its compiles), how long,
    and how a later process avoids it."""
    if interface.said:
        return
    interface.said = True
    waited = [f"importing flash-attn-4 ({interface.seconds:.1f} s)"] if interface.seconds else []
    if compiled:
        waited.append(f"compiling {compiled} kernels")
    why = stored.store_problem()
    after = (f"it could not be stored for later processes ({why})" if why else
             "later processes load it in milliseconds; `dilated-attn warmup --backend fa4` with a run's shapes stores "
             "them ahead of time")
    warn_once(f"dilated_attn: the fa4 backend's first call of a shape waited for {' and '.join(waited) or 'the interface'}"
              f" ({interface.seconds + seconds:.1f} s in all); {after}")


class Deferred:
    """FlashAttention-4's interface module, imported by the `load` it is given at its first use (`get()`,
    thread-safe): a process whose calls all find stored programs never imports it (seconds). Its attributes are the
    module's."""

    def __init__(self, load: Callable[[], object]):
        self._load = load
        self._lock = threading.Lock()
        self.module = None
        self.seconds = 0.0  # the import's
        self.said = False  # whether a first call's wait was reported (_say_first)

    def get(self):
        if self.module is None:
            with self._lock:
                if self.module is None:
                    began = time.perf_counter()
                    module = self._load()
                    self.seconds = time.perf_counter() - began
                    self.module = module
        return self.module

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and inspection ask for these: they are not the interface's
            raise AttributeError(name)
        return getattr(self.get(), name)


def _verified(interface) -> bool:
    """Whether calls of `interface` go directly (path()), asked once per interface (of a Deferred one not yet
    imported, of the installed version)."""
    if isinstance(interface, Deferred):
        interface = interface.module
        if interface is None:
            return path(None)[0]
    known = _PATHS.get(id(interface))
    if known is None or known[0] is not interface:
        known = _PATHS[id(interface)] = (interface, path(interface))
    return known[1][0]


_PATHS: dict = {}  # id(interface) -> (interface, path(interface))


def version_of(interface=None) -> str:
    """The flash-attn-4 version of `interface` (a stand-in may say its own, as `__version__`; FlashAttention's
    interface module has none), or the installed package's ("" where none is)."""
    if isinstance(interface, Deferred):
        interface = interface.module
    version = getattr(interface, "__version__", None)
    return _installed_version() if version is None else version


def path(interface=None) -> tuple[bool, str]:
    """(whether the fa4 backend calls FlashAttention-4's kernels directly, in words which path its calls take and
    why) for `interface` (None: the installed package, not imported: its version only)."""
    if not ENABLED:
        return False, f"FlashAttention-4's interface on every call: {DIRECT_ENV}=0 turned the direct calls off"
    if isinstance(interface, Deferred):
        interface = interface.module
    version = version_of(interface)
    if version not in VERIFIED_VERSIONS:
        return False, (f"FlashAttention-4's interface on every call: flash-attn-4 {version or '(no version)'} is not "
                       f"a version whose direct kernel calls the GPU tests verified ({', '.join(VERIFIED_VERSIONS)}); "
                       f"correct, with more host time a call")
    if interface is not None and not any(hasattr(f, "compile_cache") for f in vars(interface).values()
                                         if callable(f)):
        return False, (f"FlashAttention-4's interface on every call: flash-attn-4 {version}'s interface has no "
                       f"compile caches to watch")
    return True, f"flash-attn-4 {version}'s kernels, called directly after each shape's first call"


@functools.lru_cache(maxsize=1)
def _installed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return ""


# What the ops pass FlashAttention-4's private calls (which take preallocated results, as its public functions do not):
# each is checked when flash-attn-4 loads (check_interface), so that another version whose calls differ is refused
# with a reason instead of called wrongly.
_KEYWORDS = {
    "_flash_attn_fwd": ("softmax_scale", "causal", "return_lse", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                        "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k"),
    "_flash_attn_bwd": ("softmax_scale", "causal", "deterministic", "dlse", "dq", "dk", "dv", "cu_seqlens_q",
                        "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k"),
}


def check_interface(interface) -> Optional[str]:
    """None where `interface` has the calls the fa4 backend makes, with the keywords it passes; else why not."""
    import inspect

    for name, keywords in _KEYWORDS.items():
        function = getattr(interface, name, None)
        if not callable(function):
            return f"flash-attn-4 {version_of(interface)} has no {name}, which the fa4 backend calls"
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):  # a builtin without a signature: taken as it is
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        missing = [k for k in keywords if k not in parameters]
        if missing:
            return (f"flash-attn-4 {version_of(interface)}'s {name} takes no {', '.join(missing)}, which the fa4 "
                    f"backend passes")
    return None


FORWARD, BACKWARD = Direct("forward"), Direct("backward")
_LENGTHS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")


def _contiguous_aligned(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`x` contiguous at a 16-byte aligned address, as FlashAttention takes an LSE (it copies one that is not)."""
    if x is None or (x.is_contiguous() and x.data_ptr() % 16 == 0):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def forward(interface, q, k, v, scale: float, causal: bool, options: dict, out=None, lse=None, **lengths):
    """FlashAttention's forward `(out, lse)` of q, k, v (`[b, s, h, d]`, or `[total, h, d]` with `lengths`, its
    varlen arguments), written into out and lse where they are given."""
    given = (q, k, v, out, lse) + tuple(lengths.get(name) for name in _LENGTHS)
    key = (bool(causal), float(scale), tuple(sorted(options.items())), lengths.get("max_seqlen_q"),
           lengths.get("max_seqlen_k"))
    result = FORWARD.call(interface, given, key, lambda: interface._flash_attn_fwd(
        q, k, v, softmax_scale=scale, causal=causal, return_lse=True, out=out, lse=lse, **options, **lengths))
    return result[0], result[1]


def backward(interface, q, k, v, out, dout, lse, scale: float, causal: bool, deterministic: bool, dlse=None,
             dq=None, dk=None, dv=None, **lengths) -> tuple:
    """FlashAttention's backward `(dq, dk, dv)` (with `lengths`, its varlen arguments), written into dq, dk, dv where
    they are given. The LSE and its gradient go in contiguous and aligned, as FlashAttention would copy them."""
    lse, dlse = _contiguous_aligned(lse), _contiguous_aligned(dlse)
    given = (q, k, v, out, dout, lse, dlse, dq, dk, dv) + tuple(lengths.get(name) for name in _LENGTHS)
    key = (bool(causal), float(scale), bool(deterministic), lengths.get("max_seqlen_q"), lengths.get("max_seqlen_k"))
    result = BACKWARD.call(interface, given, key, lambda: interface._flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, deterministic=deterministic, dlse=dlse, dq=dq,
        dk=dk, dv=dv, **lengths))
    return tuple(result[:3])
