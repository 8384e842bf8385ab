"""Run an mx.fast.metal_kernel kernel on the CPU by compiling its exact source as C++.

Metal is not available on Linux CI, so the kernels' own code would otherwise go untested. This
driver takes the same arguments as ``mx.fast.metal_kernel`` and its call, generates the
function signature the way MLX's generator does (``write_signature`` in
mlx/backend/metal/custom_kernel.cpp, MLX 0.32), compiles header + signature + body with g++
against ``metal_shim.h`` (a small model of the Metal features kernels use) and
``runtime.cpp`` (threads of a threadgroup as fibers, so barriers and simd_* exchange values
for real), and runs the grid.

``run_kernel(...)`` returns numpy arrays; ``metal_kernel(...)`` is a drop-in replacement for
``mx.fast.metal_kernel`` whose call returns mx arrays, so Python glue written for MLX can be
exercised unchanged. Compiled libraries are cached on disk by a hash of everything that goes
into them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HARNESS_DIR = Path(__file__).resolve().parent
ABI_VERSION = 4
# Inputs with fewer elements go to the constant address space (MLX: max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8
MAX_THREADS_PER_THREADGROUP = 1024

# The attributes MLX binds when their name occurs anywhere in the kernel body, in its order.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

CXX_FLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-pthread",
    "-U_FORTIFY_SOURCE",
    "-fno-exceptions",
    "-fsingle-precision-constant",  # Metal literals are float
    "-Werror=attributes",  # an unknown [[attribute]] must not be ignored silently
    "-Werror=return-type",
    "-fno-finite-loops",  # an endless loop must hang (and time out), not vanish
)


class HarnessError(RuntimeError):
    """Base class: the harness could not give a result."""


class HarnessUnavailable(HarnessError):
    """No C++ compiler here."""


class KernelCompileError(HarnessError):
    """The kernel (or a Metal feature it uses that the shim refuses) did not compile."""


class KernelRuntimeError(HarnessError):
    """The kernel faulted, deadlocked, diverged at a collective, or timed out."""


# ---------------------------------------------------------------------------------------------
# Dtypes


@dataclass(frozen=True)
class _DType:
    name: str  # MLX dtype name
    metal: str  # get_type_string
    storage: Any  # numpy dtype holding the bytes


_DTYPES = {
    d.name: d
    for d in (
        _DType("bool", "bool", np.dtype(np.bool_)),
        _DType("uint8", "uint8_t", np.dtype(np.uint8)),
        _DType("uint16", "uint16_t", np.dtype(np.uint16)),
        _DType("uint32", "uint32_t", np.dtype(np.uint32)),
        _DType("uint64", "uint64_t", np.dtype(np.uint64)),
        _DType("int8", "int8_t", np.dtype(np.int8)),
        _DType("int16", "int16_t", np.dtype(np.int16)),
        _DType("int32", "int32_t", np.dtype(np.int32)),
        _DType("int64", "int64_t", np.dtype(np.int64)),
        _DType("float16", "float16_t", np.dtype(np.float16)),
        _DType("bfloat16", "bfloat16_t", np.dtype(np.uint16)),
        _DType("float32", "float", np.dtype(np.float32)),
        _DType("float64", "double", np.dtype(np.float64)),
    )
}


def _dtype(spec: Any) -> _DType:
    """Accept an mx.Dtype, a numpy dtype / type, or a dtype name."""
    if isinstance(spec, _DType):
        return spec
    text = str(spec)
    if text.startswith("mlx.core."):
        text = text[len("mlx.core.") :]
    if text == "bool_":
        text = "bool"
    if text in _DTYPES:
        return _DTYPES[text]
    try:
        return _DTYPES[np.dtype(spec).name]
    except (TypeError, KeyError):
        raise ValueError(f"dtype {spec!r} is not supported by the harness") from None


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even, NaN kept quiet: what Metal's float -> bfloat does."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


@dataclass
class _Array:
    """An input as the kernel sees it: element strides, storage view, and dtype."""

    data: np.ndarray  # storage dtype, possibly strided
    dtype: _DType

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        item = self.data.dtype.itemsize
        return tuple(int(s) // item for s in self.data.strides)


@dataclass
class _Meta:
    """What the signature depends on: dtype, rank and element count (no data needed)."""

    dtype: _DType
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _meta(x: Any) -> _Meta:
    if isinstance(x, (_Array, _Meta)):
        return _Meta(x.dtype, tuple(x.shape))
    if isinstance(x, np.ndarray) or np.isscalar(x):
        arr = np.asarray(x)
        return _Meta(_dtype(arr.dtype), arr.shape)
    return _Meta(_dtype(x.dtype), tuple(int(s) for s in x.shape))  # an mx.array, unevaluated


def _as_input(x: Any) -> _Array:
    if isinstance(x, np.ndarray) or np.isscalar(x):
        arr = np.asarray(x)
        return _Array(arr, _dtype(arr.dtype))
    # An mx.array: keep its real strides (memoryview exposes them), as MLX passes them when
    # ensure_row_contiguous is off.
    import mlx.core as mx

    if not isinstance(x, mx.array):
        raise TypeError(f"inputs must be numpy or mx arrays, not {type(x).__name__}")
    dt = _dtype(x.dtype)
    src = x.view(mx.uint16) if dt.name == "bfloat16" else x
    mx.eval(src)
    return _Array(np.asarray(memoryview(src)).view(dt.storage), dt)


# ---------------------------------------------------------------------------------------------
# Source generation (mirrors MLX's write_signature / write_template / kernel naming)


@dataclass
class _Param:
    kind: str  # "input", "shape", "strides", "ndim", "output", "attr"
    index: int  # input/output index, or attribute position
    metal: str  # declaration as MLX writes it, with its [[attribute]]
    cxx: str  # the same declaration without the attribute


def _template_value(value: Any) -> tuple[str, str]:
    """(parameter kind, value text) exactly as MLX prints them."""
    if isinstance(value, bool):
        return "bool", "1" if value else "0"
    if isinstance(value, (int, np.integer)):
        return "int", str(int(value))
    return "typename", _dtype(value).metal


def kernel_name(
    name: str,
    template: Sequence[tuple[str, Any]],
    inputs: Sequence[_Meta | _Array],
    output_dtypes: Sequence[Any],
) -> str:
    """The host name MLX gives the instantiation (custom_kernel_<name>_<template>_<dtypes>)."""
    full = "custom_kernel_" + name
    if template:
        tdef = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
        thash = re.sub(r"<|>|(, )", "_", tdef)[:-1]
        full += "_" + thash
    for arr in inputs:
        full += "_" + arr.dtype.metal
        if arr.ndim == 0:
            full += "s"
        elif arr.size < MAX_CONSTANT_ARRAY_SIZE:
            full += "c"
    for dt in output_dtypes:
        full += "_" + _dtype(dt).metal
    return full


def _signature_params(
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[_Meta | _Array],
    output_names: Sequence[str],
    output_dtypes: Sequence[Any],
) -> tuple[list[_Param], list[tuple[bool, bool, bool]]]:
    shape_infos = [
        (n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source)
        for n in input_names
    ]
    params: list[_Param] = []
    index = 0
    for i, (name, arr) in enumerate(zip(input_names, inputs, strict=True)):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        decl = f"  const {location} {arr.dtype.metal}{ref} {name}"
        params.append(_Param("input", i, f"{decl} [[buffer({index})]]", decl))
        index += 1
        if arr.ndim > 0:
            has_shape, has_strides, has_ndim = shape_infos[i]
            for flag, kind, decl in (
                (has_shape, "shape", f"  const constant int* {name}_shape"),
                (has_strides, "strides", f"  const constant int64_t* {name}_strides"),
                (has_ndim, "ndim", f"  const constant int& {name}_ndim"),
            ):
                if flag:
                    params.append(_Param(kind, i, f"{decl} [[buffer({index})]]", decl))
                    index += 1
    for i, (name, dt) in enumerate(zip(output_names, output_dtypes, strict=True)):
        decl = f"  device {_dtype(dt).metal}* {name}"
        params.append(_Param("output", i, f"{decl} [[buffer({index})]]", decl))
        index += 1
    for pos, (attr, typ) in enumerate(a for a in METAL_ATTRIBUTES if a[0] in source):
        decl = f"  {typ} {attr}"
        params.append(_Param("attr", pos, f"{decl} [[{attr}]]", decl))
    return params, shape_infos


def _join_params(params: list[_Param], n_inputs: int, n_outputs: int, metal: bool) -> str:
    """Separators as MLX writes them, including its index-based test after each output."""
    text = ""
    n_attrs = sum(p.kind == "attr" for p in params)
    buffer_index = 0
    for p in params:
        decl = p.metal if metal else p.cxx
        if p.kind == "attr":
            last = p.index == n_attrs - 1
            text += decl + (") {\n" if last else ",\n")
        elif p.kind == "output":
            text += decl
            if buffer_index < n_inputs + n_outputs - 1 or n_attrs > 0:
                text += ",\n"
            else:
                text += ") {\n"
            buffer_index += 1
        else:
            text += decl + ",\n"
            buffer_index += 1
    return text


def generate_source(
    *,
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Any],
    template: Sequence[tuple[str, Any]],
    output_dtypes: Sequence[Any],
    metal: bool = True,
) -> str:
    """The kernel text MLX hands to the Metal compiler (after utils.h), or its C++ twin.

    Both come from one walk over the same parameter list, so the harness compiles the layout
    MLX generates; the C++ form only drops [[attributes]] and the explicit instantiation.
    """
    arrays = [_meta(a) for a in inputs]
    full_name = kernel_name(name, template, arrays, output_dtypes)
    params, _ = _signature_params(source, input_names, arrays, output_names, output_dtypes)
    text = header
    if not metal:
        text = '#line 1 "kernel header"\n' + header + '\n#line 1 "generated signature"\n'
    if template:
        text += (
            "template <" + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template) + ">\n"
        )
    text += ("[[kernel]] void " if metal else "void ") + full_name + "(\n"
    text += _join_params(params, len(arrays), len(output_names), metal)
    if not metal:
        text += '#line 1 "kernel source"\n'
    text += source
    text += "\n}\n"
    if metal and template:
        tdef = full_name + "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
        text += f'\ntemplate [[host_name("{full_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return text


def _cxx_translation_unit(
    *,
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    arrays: Sequence[_Array],
    template: Sequence[tuple[str, Any]],
    output_dtypes: Sequence[Any],
) -> str:
    body = generate_source(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=source,
        header=header,
        inputs=arrays,
        template=template,
        output_dtypes=output_dtypes,
        metal=False,
    )
    full_name = kernel_name(name, template, arrays, output_dtypes)
    params, _ = _signature_params(source, input_names, arrays, output_names, output_dtypes)
    targs = ""
    if template:
        targs = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
    args = []
    slot = 0
    for p in params:
        decl = p.cxx.strip()
        pname = decl.split()[-1]
        ctype = decl[: -len(pname)].strip()
        if p.kind == "attr":
            field = f"a->{pname}"
            args.append(f"mshim::to_uint3({field})" if ctype == "uint3" else field)
            continue
        if ctype.endswith("&"):
            args.append(f"*({ctype[:-1].strip()}*)b[{slot}]")
        else:
            args.append(f"({ctype})b[{slot}]")
        slot += 1
    call = ",\n      ".join(args)
    return (
        '#include "metal_shim.h"\n'
        + body
        + '#line 1 "generated wrapper"\n'
        + 'extern "C" void mshim_kernel_entry(void* const* b, const mshim_attrs* a) {\n'
        + "  (void)b;\n  (void)a;\n"
        + f"  {full_name}{targs}(\n      {call});\n}}\n"
    )


# ---------------------------------------------------------------------------------------------
# Compilation


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_compiler_ids: dict[str, str] = {}


def cache_dir() -> Path:
    """Where compiled kernels live ($MSHIM_CACHE_DIR, else a per-user temp folder)."""
    env = os.environ.get("MSHIM_CACHE_DIR")
    path = Path(env) if env else Path(tempfile.gettempdir()) / f"mlx_dflash_mshim_{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiler() -> str:
    """The C++ compiler ($CXX, else g++ / c++); HarnessUnavailable when there is none."""
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand) or cand
    raise HarnessUnavailable("no C++ compiler (g++) found; the Metal CPU harness needs one")


def _compiler_id(cxx: str) -> str:
    if cxx not in _compiler_ids:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
        _compiler_ids[cxx] = out.stdout
    return _compiler_ids[cxx]


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run_compiler(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        errors = "\n".join([ln for ln in proc.stderr.splitlines() if "error:" in ln][:20])
        raise KernelCompileError(
            f"{what} failed to compile as C++ against metal_shim.h (a Metal feature the shim "
            f"does not model, or a bug in the kernel):\n{errors or proc.stderr}"
        )


def _runtime_object(cxx: str) -> Path:
    files = [HARNESS_DIR / n for n in ("runtime.cpp", "mshim_abi.h")]
    key = _digest(cxx, _compiler_id(cxx), *CXX_FLAGS, *(f.read_text() for f in files))
    obj = cache_dir() / f"runtime-{key}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        _run_compiler(
            [cxx, *CXX_FLAGS, "-c", str(HARNESS_DIR / "runtime.cpp"), "-o", str(tmp)],
            "the harness runtime",
        )
        os.replace(tmp, obj)
    return obj


def compile_library(cpp_source: str, label: str = "kernel") -> Path:
    """Compile a generated translation unit (cached by content) and return the .so path."""
    cxx = compiler()
    shim = [(HARNESS_DIR / n).read_text() for n in ("metal_shim.h", "mshim_abi.h")]
    with _lock:
        runtime = _runtime_object(cxx)
    key = _digest(cxx, _compiler_id(cxx), *CXX_FLAGS, *shim, runtime.name, cpp_source)
    lib = cache_dir() / f"{label}-{key}.so"
    if not lib.exists():
        src = cache_dir() / f"{label}-{key}.cpp"
        src.write_text(cpp_source)
        tmp = lib.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        _run_compiler(
            [
                cxx,
                *CXX_FLAGS,
                f"-I{HARNESS_DIR}",
                "-shared",
                str(src),
                str(runtime),
                "-o",
                str(tmp),
                "-lm",
            ],
            f"kernel {label!r} (generated source: {src})",
        )
        os.replace(tmp, lib)
    return lib


def _load(path: Path) -> ctypes.CDLL:
    with _lock:
        if str(path) not in _libs:
            lib = ctypes.CDLL(str(path))
            lib.mshim_abi_version.restype = ctypes.c_int
            if lib.mshim_abi_version() != ABI_VERSION:
                raise HarnessError(f"{path} was built for another harness ABI")
            lib.mshim_alloc.restype = ctypes.c_void_p
            lib.mshim_alloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p]
            lib.mshim_free.argtypes = [ctypes.c_void_p]
            lib.mshim_run.restype = ctypes.c_int
            lib.mshim_run.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_int,
                ctypes.c_double,
                ctypes.c_char_p,
                ctypes.c_int,
            ]
            _libs[str(path)] = lib
        return _libs[str(path)]


# ---------------------------------------------------------------------------------------------
# Running


class _Buffers:
    """Guarded buffers (an inaccessible page follows each) owned by one run."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.ptrs: list[int] = []

    def alloc(self, nbytes: int, label: str) -> int:
        ptr = self.lib.mshim_alloc(nbytes, label.encode()[:60])
        if not ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes for {label}")
        self.ptrs.append(ptr)
        return ptr

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        if nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def put(self, arr: np.ndarray, label: str) -> int:
        """Copy `arr` (any strides >= 0) into a fresh buffer laid out with the same strides."""
        item = arr.dtype.itemsize
        if any(s < 0 for s in arr.strides):
            raise NotImplementedError("negative strides are not modelled by the harness")
        if arr.size == 0:
            extent = 0
        else:
            extent = 1 + sum(
                (n - 1) * (s // item) for n, s in zip(arr.shape, arr.strides, strict=True)
            )
        nbytes = extent * item
        ptr = self.alloc(nbytes, label)
        raw = self.view(ptr, nbytes)
        raw[:] = 0xFF  # holes between strided elements read as NaN / -1
        if extent:
            dst = np.lib.stride_tricks.as_strided(
                raw.view(arr.dtype), shape=arr.shape, strides=arr.strides
            )
            dst[...] = arr
        return ptr

    def close(self) -> None:
        for p in self.ptrs:
            self.lib.mshim_free(p)
        self.ptrs.clear()


def run_kernel(
    *,
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    inputs: Sequence[Any],
    template: Sequence[tuple[str, Any]] = (),
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[Any],
    init_value: float | None = None,
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    workers: int | None = None,
    timeout: float = 300.0,
) -> list[np.ndarray]:
    """Compile (cached) and run one kernel launch on the CPU; returns the outputs.

    Arguments mean what they mean for mx.fast.metal_kernel and its call. Unwritten output
    elements come back as NaN (or -1 for integers) unless init_value is given; bfloat16
    outputs come back as float32 holding the exact bfloat16 values.
    """
    if atomic_outputs:
        raise NotImplementedError("atomic outputs are not modelled by the Metal CPU harness")
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    for label, got, want in (
        ("inputs", len(inputs), len(input_names)),
        ("output_shapes", len(output_shapes), len(output_names)),
        ("output_dtypes", len(output_dtypes), len(output_names)),
    ):
        if got != want:
            raise ValueError(
                f"[metal_kernel] Expected `{label}` to have size {want} but got size {got}."
            )
    grid = tuple(int(g) for g in grid)
    threadgroup = tuple(int(t) for t in threadgroup)
    if len(grid) != 3 or len(threadgroup) != 3:
        raise ValueError("grid and threadgroup take three sizes each")
    if int(np.prod(threadgroup)) > MAX_THREADS_PER_THREADGROUP:
        raise ValueError(
            f"Thread group size ({int(np.prod(threadgroup))}) is greater than the maximum "
            f"allowed threads per threadgroup ({MAX_THREADS_PER_THREADGROUP})."
        )
    group = tuple(min(t, g) for t, g in zip(threadgroup, grid, strict=True))

    arrays = [_as_input(x) for x in inputs]
    if ensure_row_contiguous:
        arrays = [_Array(np.ascontiguousarray(a.data), a.dtype) for a in arrays]
    cpp = _cxx_translation_unit(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=source,
        header=header,
        arrays=arrays,
        template=template,
        output_dtypes=output_dtypes,
    )
    lib = _load(compile_library(cpp, label=re.sub(r"\W", "_", name)))
    params, _ = _signature_params(source, input_names, arrays, output_names, output_dtypes)

    bufs = _Buffers(lib)
    try:
        pointers: list[int] = []
        outputs: list[tuple[int, np.ndarray, _DType]] = []
        for p in params:
            if p.kind == "input":
                pointers.append(bufs.put(arrays[p.index].data, input_names[p.index]))
            elif p.kind == "shape":
                a = np.asarray(arrays[p.index].shape, dtype=np.int32)
                pointers.append(bufs.put(a, input_names[p.index] + "_shape"))
            elif p.kind == "strides":
                a = np.asarray(arrays[p.index].strides, dtype=np.int64)
                pointers.append(bufs.put(a, input_names[p.index] + "_strides"))
            elif p.kind == "ndim":
                a = np.asarray(arrays[p.index].ndim, dtype=np.int32)
                pointers.append(bufs.put(a, input_names[p.index] + "_ndim"))
            elif p.kind == "output":
                dt = _dtype(output_dtypes[p.index])
                shape = tuple(int(s) for s in output_shapes[p.index])
                out = np.empty(shape, dtype=dt.storage)
                if init_value is None:
                    out.view(np.uint8)[...] = 0xFF
                elif dt.name == "bfloat16":
                    out[...] = _f32_to_bf16(np.full(shape, init_value, dtype=np.float32))
                else:
                    out[...] = init_value
                ptr = bufs.put(out, output_names[p.index])
                pointers.append(ptr)
                outputs.append((ptr, out, dt))
        c_ptrs = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
        c_grid = (ctypes.c_uint * 3)(*grid)
        c_group = (ctypes.c_uint * 3)(*group)
        err = ctypes.create_string_buffer(2048)
        n_workers = workers or min(8, os.cpu_count() or 1)
        rc = lib.mshim_run(c_ptrs, c_grid, c_group, n_workers, float(timeout), err, len(err))
        if rc != 0:
            raise KernelRuntimeError(f"kernel {name!r}: {err.value.decode(errors='replace')}")
        results = []
        for ptr, out, dt in outputs:
            nbytes = out.nbytes
            out.reshape(-1).view(np.uint8)[:] = bufs.view(ptr, nbytes)
            results.append(_bf16_to_f32(out) if dt.name == "bfloat16" else out)
        return results
    finally:
        bufs.close()


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: Any = None,
):
    """Drop-in for mx.fast.metal_kernel that runs on the CPU harness and returns mx arrays."""
    del compile_options  # math mode: the shim always uses IEEE ("safe") math

    def call(
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=(),
        init_value=None,
        verbose=False,
        stream=None,
    ):
        import mlx.core as mx

        del stream
        if verbose:
            print(
                generate_source(
                    name=name,
                    input_names=input_names,
                    output_names=output_names,
                    source=source,
                    header=header,
                    inputs=inputs,
                    template=template,
                    output_dtypes=output_dtypes,
                )
            )
        outs = run_kernel(
            name=name,
            input_names=input_names,
            output_names=output_names,
            source=source,
            header=header,
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            init_value=init_value,
            ensure_row_contiguous=ensure_row_contiguous,
            atomic_outputs=atomic_outputs,
        )
        result = []
        for arr, dt in zip(outs, output_dtypes, strict=True):
            if _dtype(dt).name == "bfloat16":
                result.append(mx.array(arr).astype(mx.bfloat16))
            else:
                result.append(mx.array(arr))
        return result

    return call
