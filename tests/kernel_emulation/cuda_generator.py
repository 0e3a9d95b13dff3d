"""Run ``mx.fast.cuda_kernel`` launches on the CPU: the CUDA front end of the emulator.

For each launch the generator writes the text MLX itself hands to NVRTC (``build_kernel`` in
MLX's ``backend/cuda/custom_kernel.cpp`` as of the 0.32 line, mirrored here: the header, the
``__global__`` signature with every input as ``const T*`` followed by its ``_shape`` /
``_strides`` / ``_ndim`` parameters when the body mentions them, the outputs, the template
arguments as ``constexpr`` values and ``using`` aliases, then the body), with
``#include "cuda_emu.h"`` in place of MLX's default header. The build, the guarded buffers and
the threadgroup scheduler are the Metal emulator's (``generator.py``, ``metal_emu_runtime.cpp``);
MLX launches ``ceil(grid / block)`` full blocks, so the grid is rounded up here the same way.
"""

from __future__ import annotations

import mlx.core as mx

from engine.attention.plans import KernelSource, Launch, Ref
from tests.kernel_emulation import generator as gen

CUDA_SHARED_LIMIT = 49152  # bytes of static __shared__ memory per block

# MLX's dtype_to_cuda_type.
_CUDA_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}


def cuda_type(dtype: mx.Dtype) -> str:
    return _CUDA_TYPES[dtype]


def template_hash(template) -> str:
    """MLX's ``template_arguments_hash``: ``_<int>``, ``_t``/``_f`` or ``_<type string>``."""
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + gen.type_string(value)
    return out


def kernel_name(name: str, template) -> str:
    return "custom_kernel_" + name + template_hash(template)


def buffer_list(kernel: KernelSource, inputs: list[gen.ArgSpec], output_dtypes) -> list[gen.Buffer]:
    """The kernel's parameters in order; every input is a pointer (0-d ones too), ``_ndim``
    is an int passed by value."""
    buffers: list[gen.Buffer] = []
    for i, (arg, (has_shape, has_strides, has_ndim)) in enumerate(
        zip(inputs, gen.shape_infos(kernel), strict=True)
    ):
        buffers.append(gen.Buffer("input", i, cuda_type(arg.dtype), False))
        if arg.shape:
            if has_shape:
                buffers.append(gen.Buffer("shape", i, "int32_t", False))
            if has_strides:
                buffers.append(gen.Buffer("strides", i, "int64_t", False))
            if has_ndim:
                buffers.append(gen.Buffer("ndim", i, "int", True))
    for i, dtype in enumerate(output_dtypes):
        buffers.append(gen.Buffer("output", i, cuda_type(dtype), False))
    return buffers


def mlx_source(kernel: KernelSource, inputs: list[gen.ArgSpec], output_dtypes, template) -> str:
    """The text MLX 0.32 generates for this call after its default header."""
    out = [kernel.header]
    out.append("namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n")
    out.append(f"__global__ void {kernel_name(kernel.name, template)}(\n")
    infos = gen.shape_infos(kernel)
    params = []
    for i, (name, arg) in enumerate(zip(kernel.input_names, inputs, strict=True)):
        params.append(f"    const {cuda_type(arg.dtype)}* {name}")
        if arg.shape:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                params.append(f"    const __grid_constant__ Shape {name}_shape")
            if has_strides:
                params.append(f"    const __grid_constant__ Strides {name}_strides")
            if has_ndim:
                params.append(f"    const __grid_constant__ int {name}_ndim")
    for name, dtype in zip(kernel.output_names, output_dtypes, strict=True):
        params.append(f"    {cuda_type(dtype)}* {name}")
    out.append(",\n".join(params) + ") {\n")
    if template:
        for name, value in template:
            if isinstance(value, bool):
                out.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
            elif isinstance(value, int):
                out.append(f"  constexpr int {name} = {value};\n")
            else:
                out.append(f"  using {name} = {cuda_type(value)};\n")
        out.append("\n")
    out.append(kernel.source)
    out.append("\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(out)


def emulator_source(
    kernel: KernelSource, inputs: list[gen.ArgSpec], output_dtypes, template
) -> str:
    """A complete C++ program: the MLX-generated text plus an entry point for the runtime."""
    buffers = buffer_list(kernel, inputs, output_dtypes)
    args = []
    for k, buf in enumerate(buffers):
        const = "" if buf.kind == "output" else "const "
        if buf.by_ref:
            args.append(f"*static_cast<{const}{buf.ctype}*>(b[{k}])")
        else:
            args.append(f"static_cast<{const}{buf.ctype}*>(b[{k}])")
    joined = ",\n      ".join(args)
    return (
        '#include "cuda_emu.h"\n'
        "// ---- generated as by mx.fast.cuda_kernel ----\n"
        + mlx_source(kernel, inputs, output_dtypes, template)
        + "// ---- emulator entry ----\n"
        + "static void metal_emu_lane_entry(void* const* b, const metal_emu::LaneAttrs& a) {\n"
        + "  metal_emu::tls_lane->user = &a;\n"
        + f"  mlx::core::cu::{kernel_name(kernel.name, template)}(\n      {joined});\n"
        + "}\n"
        + "int main(int argc, char** argv) {\n"
        + f"  return metal_emu::run_main(argc, argv, metal_emu_lane_entry, {len(buffers)});\n"
        + "}\n"
    )


def launch_grid(launch: Launch) -> tuple[int, int, int]:
    """MLX's CUDA launch: ceil(grid / block) blocks of full size, i.e. the grid in threads
    rounded up to whole blocks."""
    return tuple(
        -(-g // t) * t for g, t in zip(launch.grid, launch.threadgroup, strict=True)
    )


FRONTEND = gen.Frontend(
    emulator_source=emulator_source,
    buffer_list=buffer_list,
    launch_grid=launch_grid,
    tg_limit=CUDA_SHARED_LIMIT,
)


def run_plan(
    plan: list[Launch], *, mode: str = "ordered", extra_flags: tuple[str, ...] = ()
) -> list[list[mx.array]]:
    """Execute a launch plan (``engine.attention.cuda.plan_attention``) in the emulator."""
    results: list[list[mx.array]] = []
    for launch in plan:
        inputs = gen.resolve_inputs(launch, results)
        results.append(
            gen.run_launch(
                launch, inputs, mode=mode, extra_flags=extra_flags, frontend=FRONTEND
            ).outputs
        )
    return results


def plan_specs(plan: list[Launch]) -> list[list[gen.ArgSpec]]:
    """Each launch's input specs (intermediate shapes come from output_shapes)."""
    specs_per_launch = []
    shapes: list[list[gen.ArgSpec]] = []
    for launch in plan:
        specs = [
            shapes[x.launch][x.output]
            if isinstance(x, Ref)
            else gen.ArgSpec(x.dtype, tuple(x.shape))
            for x in launch.inputs
        ]
        shapes.append(
            [
                gen.ArgSpec(d, tuple(s))
                for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)
            ]
        )
        specs_per_launch.append(specs)
    return specs_per_launch


def plan_sources(plan: list[Launch]) -> list[str]:
    """The emulator programs a plan needs."""
    return [
        emulator_source(launch.kernel, specs, launch.output_dtypes, launch.template)
        for launch, specs in zip(plan, plan_specs(plan), strict=True)
    ]
