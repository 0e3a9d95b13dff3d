"""Run ``mx.fast.metal_kernel`` launches on the CPU: generate, compile (g++) and execute.

For each launch the generator writes the source text MLX itself would hand to the Metal
compiler (``write_signature``, the kernel name and the explicit template instantiation of
MLX's ``metal_kernel`` as of the 0.32 line, mirrored here, including the substring rules that
decide which ``*_shape`` / ``*_strides`` / ``*_ndim`` buffers and which attributes appear),
with ``#include "metal_emu.h"`` in place of MLX's Metal preamble. A small entry function then
calls the kernel once per emulated thread and ``main`` hands control to the runtime
(``metal_emu_runtime.cpp``), which reads the launch description and raw buffers from files.

Builds are cached by a hash of everything that goes into them under ``tests/.kernel_build/``
(git-ignored), so a binary is compiled once per template instantiation and reused.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.attention.plans import KernelSource, Launch, Ref

HERE = Path(__file__).resolve().parent
HEADER = HERE / "metal_emu.h"
CUDA_HEADER = HERE / "cuda_emu.h"  # the CUDA front end (cuda_generator.py)
RUNTIME = HERE / "metal_emu_runtime.cpp"
LINKER_SCRIPT = HERE / "tg.ld"
BUILD_DIR = HERE.parent / ".kernel_build"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ("-std=c++20", "-O2", "-pthread")
KERNEL_FLAGS = ("-Wno-attributes", "-Wno-unknown-pragmas", "-fdata-sections")
RUN_TIMEOUT_S = 300.0

# mx.fast.metal_kernel's attribute table (name, type), in MLX's order.
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

# MLX's get_type_string, and the numpy dtype that carries the same bytes.
_TYPES = {
    mx.bool_: ("bool", np.bool_),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),  # raw bits
    mx.float32: ("float", np.float32),
}

MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: smaller inputs go to the `constant` address space


class EmulatorError(RuntimeError):
    """The emulated kernel failed: a detected Metal error, a crash, or a build failure."""


def type_string(dtype: mx.Dtype) -> str:
    return _TYPES[dtype][0]


def template_value(value) -> str:
    if isinstance(value, bool):  # MLX streams a bool with operator<<: 1 / 0
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return type_string(value)


def template_def(template) -> str:
    return "<" + ", ".join(template_value(v) for _, v in template) + ">"


def kernel_name(name: str, template, inputs: list[ArgSpec], output_dtypes) -> str:
    """``custom_kernel_<name>``, MLX's sanitised template suffix, then one ``_<type>`` per input
    (``s`` suffix for 0-d, ``c`` for the constant address space) and per output."""
    kname = "custom_kernel_" + name
    if template:
        suffix = re.sub(r"<|>|(, )", "_", template_def(template))[:-1]
        kname += "_" + suffix
    for arg in inputs:
        kname += "_" + type_string(arg.dtype)
        if len(arg.shape) == 0:
            kname += "s"
        elif arg.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for dtype in output_dtypes:
        kname += "_" + type_string(dtype)
    return kname


@dataclass(frozen=True)
class ArgSpec:
    """What the generated signature needs to know about one input array."""

    dtype: mx.Dtype
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Buffer:
    """One entry of the kernel's buffer list, in signature order."""

    kind: str  # "input", "shape", "strides", "ndim", "output"
    arg: int  # index of the input / output it belongs to
    ctype: str
    by_ref: bool  # `const constant T& name` (0-d input, ndim)


def shape_infos(kernel: KernelSource) -> list[tuple[bool, bool, bool]]:
    """MLX: a ``name_shape``/``_strides``/``_ndim`` buffer exists if the body mentions it."""
    src = kernel.source
    return [
        (f"{n}_shape" in src, f"{n}_strides" in src, f"{n}_ndim" in src) for n in kernel.input_names
    ]


def attributes(kernel: KernelSource) -> list[tuple[str, str]]:
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in kernel.source]


def buffer_list(kernel: KernelSource, inputs: list[ArgSpec], output_dtypes) -> list[Buffer]:
    buffers: list[Buffer] = []
    for i, (arg, (has_shape, has_strides, has_ndim)) in enumerate(
        zip(inputs, shape_infos(kernel), strict=True)
    ):
        buffers.append(Buffer("input", i, type_string(arg.dtype), len(arg.shape) == 0))
        if arg.shape:
            if has_shape:
                buffers.append(Buffer("shape", i, "int", False))
            if has_strides:
                buffers.append(Buffer("strides", i, "int64_t", False))
            if has_ndim:
                buffers.append(Buffer("ndim", i, "int", True))
    for i, dtype in enumerate(output_dtypes):
        buffers.append(Buffer("output", i, type_string(dtype), False))
    return buffers


def mlx_source(kernel: KernelSource, inputs: list[ArgSpec], output_dtypes, template) -> str:
    """The text MLX 0.32 generates for this call (after its preamble): header, signature, body
    and explicit instantiation."""
    kname = kernel_name(kernel.name, template, inputs, output_dtypes)
    out = [kernel.header]
    if template:
        kinds = []
        for name, value in template:
            kind = (
                "bool"
                if isinstance(value, bool)
                else "int"
                if isinstance(value, int)
                else ("typename")
            )
            kinds.append(f"{kind} {name}")
        out.append("template <" + ", ".join(kinds) + ">\n")
    out.append(f"[[kernel]] void {kname}(\n")
    params = []
    index = 0
    infos = shape_infos(kernel)
    for i, (name, arg) in enumerate(zip(kernel.input_names, inputs, strict=True)):
        location = "constant" if arg.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(arg.shape) == 0 else "*"
        ctype = type_string(arg.dtype)
        params.append(f"  const {location} {ctype}{ref} {name} [[buffer({index})]]")
        index += 1
        if arg.shape:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                params.append(f"  const constant int* {name}_shape [[buffer({index})]]")
                index += 1
            if has_strides:
                params.append(f"  const constant int64_t* {name}_strides [[buffer({index})]]")
                index += 1
            if has_ndim:
                params.append(f"  const constant int& {name}_ndim [[buffer({index})]]")
                index += 1
    for name, dtype in zip(kernel.output_names, output_dtypes, strict=True):
        params.append(f"  device {type_string(dtype)}* {name} [[buffer({index})]]")
        index += 1
    for attr, atype in attributes(kernel):
        params.append(f"  {atype} {attr} [[{attr}]]")
    out.append(",\n".join(params) + ") {\n")
    out.append(kernel.source)
    out.append("\n}\n")
    if template:
        tdef = kname + template_def(template)
        out.append(f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n')
    return "".join(out)


def emulator_source(kernel: KernelSource, inputs: list[ArgSpec], output_dtypes, template) -> str:
    """A complete C++ program: the MLX-generated text plus an entry point for the runtime."""
    kname = kernel_name(kernel.name, template, inputs, output_dtypes)
    call = kname + (template_def(template) if template else "")
    buffers = buffer_list(kernel, inputs, output_dtypes)
    args = []
    for k, buf in enumerate(buffers):
        const = "" if buf.kind == "output" else "const "
        if buf.by_ref:
            args.append(f"*static_cast<{const}{buf.ctype}*>(b[{k}])")
        else:
            args.append(f"static_cast<{const}{buf.ctype}*>(b[{k}])")
    args += [f"a.{attr}" for attr, _ in attributes(kernel)]
    joined = ",\n      ".join(args)
    return (
        '#include "metal_emu.h"\n'
        "// ---- generated as by mx.fast.metal_kernel ----\n"
        + mlx_source(kernel, inputs, output_dtypes, template)
        + "// ---- emulator entry ----\n"
        + "static void metal_emu_lane_entry(void* const* b, const metal_emu::LaneAttrs& a) {\n"
        + "  (void)a;\n"
        + f"  {call}(\n      {joined});\n"
        + "}\n"
        + "int main(int argc, char** argv) {\n"
        + f"  return metal_emu::run_main(argc, argv, metal_emu_lane_entry, {len(buffers)});\n"
        + "}\n"
    )


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def emulation_available() -> tuple[bool, str]:
    """(available, reason): the emulator is built and verified on Linux with GNU tools (a
    linker script places threadgroup memory; fibers switch in x86-64 assembly or ucontext)."""
    if not sys.platform.startswith("linux"):
        return False, "the CPU emulator targets Linux; on a Mac run the GPU tests (-m mac)"
    if not compiler_available():
        return False, f"needs {CXX}"
    return True, ""


@lru_cache(maxsize=1)
def _toolchain_id() -> str:
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
    return version.stdout


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _linker_flags() -> list[str]:
    return [f"-Wl,-T,{LINKER_SCRIPT}"] if sys.platform.startswith("linux") else []


def _compile(cmd: list[str], out: Path) -> None:
    """Run a compiler command writing ``out`` atomically (parallel builds may race)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    proc = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise EmulatorError(f"build failed: {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    os.replace(tmp, out)


@lru_cache(maxsize=4)
def runtime_object(extra_flags: tuple[str, ...] = ()) -> Path:
    key = _digest(
        HEADER.read_bytes(), RUNTIME.read_bytes(), _toolchain_id(), *CXXFLAGS, *extra_flags
    )
    obj = BUILD_DIR / "runtime" / f"metal_emu_runtime-{key}.o"
    if not obj.exists():
        _compile([CXX, *CXXFLAGS, *extra_flags, "-I", str(HERE), "-c", str(RUNTIME)], obj)
    return obj


def build(source: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile an emulator program (cached by content); returns the executable."""
    rt = runtime_object(extra_flags)
    key = _digest(
        source,
        HEADER.read_bytes(),
        CUDA_HEADER.read_bytes(),
        LINKER_SCRIPT.read_bytes(),
        rt.name,
        *KERNEL_FLAGS,
        *extra_flags,
    )
    exe = BUILD_DIR / "bin" / f"kernel-{key}"
    if exe.exists():
        return exe
    src = BUILD_DIR / "src" / f"kernel-{key}.cpp"
    src.parent.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        tmp = src.with_name(f"{src.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, src)  # another process may be writing the same file
    _compile(
        [
            CXX,
            *CXXFLAGS,
            *KERNEL_FLAGS,
            *extra_flags,
            "-I",
            str(HERE),
            str(src),
            str(rt),
            *_linker_flags(),
        ],
        exe,
    )
    return exe


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def to_numpy(a: mx.array) -> np.ndarray:
    """The array's bytes as numpy (bfloat16 as raw uint16 bits), row-contiguous."""
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def from_bytes(data: bytes, shape, dtype: mx.Dtype) -> mx.array:
    arr = np.frombuffer(data, dtype=_TYPES[dtype][1]).reshape(shape)
    out = mx.array(arr)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _describe_crash(returncode: int, stderr: str) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}\n{stderr}"
    return f"exit code {returncode}\n{stderr}"


@dataclass
class LaunchResult:
    outputs: list[mx.array]
    exe: Path
    #: The inputs the launch writes in place (``Launch.in_place``), as the kernel left them,
    #: by input index.
    written: dict[int, mx.array] = field(default_factory=dict)


@dataclass(frozen=True)
class Frontend:
    """What differs between the Metal and the CUDA source a launch is run from: the generated
    program, its parameter list, the grid the runtime dispatches, the shared-memory limit."""

    emulator_source: Callable
    buffer_list: Callable
    launch_grid: Callable[[Launch], tuple[int, int, int]]
    tg_limit: int | None = None  # None: the runtime's (Apple GPUs: 32 KiB)


def _metal_grid(launch: Launch) -> tuple[int, int, int]:
    return launch.grid  # dispatchThreads: the runtime makes the edge threadgroups non-uniform


def run_launch(
    launch: Launch,
    inputs: list[mx.array],
    *,
    mode: str = "ordered",
    extra_flags: tuple[str, ...] = (),
    frontend: Frontend | None = None,
) -> LaunchResult:
    """Execute one launch in the emulator. ``mode``: "ordered" (deterministic race exposure)
    or "free" (simdgroup threads run concurrently). ``frontend``: Metal when None."""
    fe = frontend or METAL
    kernel = launch.kernel
    specs = [ArgSpec(a.dtype, tuple(a.shape)) for a in inputs]
    exe = build(
        fe.emulator_source(kernel, specs, launch.output_dtypes, launch.template), extra_flags
    )
    buffers = fe.buffer_list(kernel, specs, launch.output_dtypes)
    with tempfile.TemporaryDirectory(prefix="metal_emu_") as tmp:
        lines = [
            "grid {} {} {}".format(*fe.launch_grid(launch)),
            "threadgroup {} {} {}".format(*launch.threadgroup),
            f"mode {mode}",
        ]
        if fe.tg_limit is not None:
            lines.append(f"tg_limit {fe.tg_limit}")
        out_paths = []
        in_place_paths = []
        for k, buf in enumerate(buffers):
            path = Path(tmp) / f"buf{k}.bin"
            if buf.kind == "output":
                shape = launch.output_shapes[buf.arg]
                nbytes = int(np.prod(shape, dtype=np.int64)) * _itemsize(
                    launch.output_dtypes[buf.arg]
                )
                lines.append(f"out {nbytes} {path}")
                out_paths.append((path, shape, launch.output_dtypes[buf.arg]))
                continue
            arr = inputs[buf.arg]
            if buf.kind == "input":
                data = to_numpy(arr).tobytes()
            elif buf.kind == "shape":
                data = np.asarray(arr.shape, dtype=np.int32).tobytes()
            elif buf.kind == "strides":
                strides = np.cumprod((arr.shape[1:] + (1,))[::-1])[::-1]
                data = np.asarray(strides, dtype=np.int64).tobytes()
            else:  # ndim
                data = np.asarray(arr.ndim, dtype=np.int32).tobytes()
            path.write_bytes(data)
            if buf.kind == "input" and buf.arg in launch.in_place:
                lines.append(f"inout {len(data)} {path}")
                in_place_paths.append((buf.arg, path))
            else:
                lines.append(f"in {len(data)} {path}")
        launch_file = Path(tmp) / "launch.txt"
        launch_file.write_text("\n".join(lines) + "\n")
        try:
            proc = subprocess.run(
                [str(exe), str(launch_file)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as e:
            raise EmulatorError(
                f"{kernel.name}: timed out after {RUN_TIMEOUT_S:.0f} s (deadlock?)"
            ) from e
        if proc.returncode != 0:
            raise EmulatorError(f"{kernel.name}: {_describe_crash(proc.returncode, proc.stderr)}")
        outputs = [from_bytes(p.read_bytes(), shape, dtype) for p, shape, dtype in out_paths]
        written = {i: from_bytes(p.read_bytes(), inputs[i].shape, inputs[i].dtype)
                   for i, p in in_place_paths}
    return LaunchResult(outputs, exe, written)


METAL = Frontend(emulator_source, buffer_list, _metal_grid)


def _itemsize(dtype: mx.Dtype) -> int:
    return np.dtype(_TYPES[dtype][1]).itemsize


def resolve_inputs(launch: Launch, results: list[list[mx.array]]) -> list[mx.array]:
    return [results[x.launch][x.output] if isinstance(x, Ref) else x for x in launch.inputs]


def run_plan(
    plan: list[Launch], *, mode: str = "ordered", extra_flags: tuple[str, ...] = ()
) -> list[list[mx.array]]:
    """Execute a launch plan (``engine.attention.metal.plan_decode``) in the emulator; returns every
    launch's outputs, like ``engine.attention.metal.KERNELS.run`` on a Mac."""
    results: list[list[mx.array]] = []
    for launch in plan:
        inputs = resolve_inputs(launch, results)
        results.append(run_launch(launch, inputs, mode=mode, extra_flags=extra_flags).outputs)
    return results


def plan_sources(plan: list[Launch]) -> list[str]:
    """The emulator programs a plan needs (intermediate shapes come from output_shapes)."""
    sources = []
    shapes: list[list[ArgSpec]] = []
    for launch in plan:
        specs = [
            shapes[x.launch][x.output] if isinstance(x, Ref) else ArgSpec(x.dtype, tuple(x.shape))
            for x in launch.inputs
        ]
        shapes.append(
            [
                ArgSpec(d, tuple(s))
                for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)
            ]
        )
        sources.append(emulator_source(launch.kernel, specs, launch.output_dtypes, launch.template))
    return sources


def prebuild(sources: list[str], extra_flags: tuple[str, ...] = ()) -> None:
    """Compile many programs in parallel (one g++ per core)."""
    runtime_object(extra_flags)
    unique = list(dict.fromkeys(sources))
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda s: build(s, extra_flags), unique))
