"""Fast matmuls on Linux from any launch: load Debian's OpenBLAS before MLX is imported.

Why: MLX's Linux CPU wheel links a slow reference BLAS (its own ``libblas``); with Debian's
openmp OpenBLAS in the process first, MLX's ``cblas_sgemm`` resolves to OpenBLAS instead and
a 1024x1024 fp32 matmul takes about 9 ms instead of 280 ms (``bench/blas_startup.py``). Only
``run.sh`` (through ``scripts/env.sh``) and the frozen bundle (its runtime hook) set
``LD_PRELOAD``; the ``pagedchat`` entry point of the virtual environment ran prefill ~21x
slower (issue 25). ``LD_PRELOAD`` cannot be set for a process that is already running, but a
library opened with ``RTLD_GLOBAL`` joins the global symbol scope, which the dynamic linker
searches before a later-opened library's own dependencies, so loading OpenBLAS with ctypes
before ``mlx`` is imported has the same effect without re-executing the process (measured:
the same speed as ``LD_PRELOAD``). Only the openmp variant: the pthread one aborts at exit
after MLX ran in a second thread (docs/FACTS.md). ``PAGEDCHAT_NO_OPENBLAS=1`` opts out.
Its OpenMP threads are told to sleep between matmuls (``OMP_WAIT_POLICY=PASSIVE``, unless the
user set a policy) instead of spinning on the cores the GUI, the engine's Python and the CPU
attention kernel need: mlx-lm took 0.88x the time per token so (docs/FACTS.md). libgomp
reads it when it loads, so it is set before the library is opened.

``state()`` says what happened, and why it is slow when it is, so the window and ``pagedchat
serve`` can tell the user. Imports neither Qt nor MLX.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

OPENBLAS_OPENMP = (
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
)
OPT_OUT = "PAGEDCHAT_NO_OPENBLAS"
WAIT_POLICY = "OMP_WAIT_POLICY"
INSTALL_HINT = "sudo apt-get install libopenblas0-openmp"


@dataclass(frozen=True)
class BlasState:
    """Which BLAS MLX's CPU matmuls use in this process, and why when it is the slow one."""

    relevant: bool  # False on macOS (Metal): nothing to say
    library: str = ""  # the file MLX's cblas_sgemm resolves to ("" when not OpenBLAS)
    how: str = ""  # "preloaded" (LD_PRELOAD: run.sh, the bundle) or "loaded" (this module)
    problem: str = ""  # why prompts are slow, in the user's words ("" when fast)

    @property
    def fast(self) -> bool:
        return not self.relevant or bool(self.library)

    @property
    def label(self) -> str:
        """For one-line reports (the self-test, ``pagedchat serve``)."""
        return "openblas" if self.library else "bundled blas"


_state: BlasState | None = None


def _resolved_sgemm() -> str:
    """The file ``cblas_sgemm`` comes from in the process's global scope ("" if none has it)."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except (AttributeError, OSError):
        return ""
    info = DlInfo()
    process.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return ""
    return os.fsdecode(info.dli_fname)


def _mlx_on_cuda() -> bool:
    """MLX's CUDA wheel is installed: matmuls run on the GPU, the CPU BLAS hardly matters."""
    from importlib import metadata

    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("mlx-cuda")
               for d in metadata.distributions())


def _slow(reason: str) -> BlasState:
    return BlasState(relevant=True, problem=reason)


def load() -> BlasState:
    """Make MLX's CPU matmuls use OpenBLAS if it can still be done; idempotent.

    Call it before anything imports ``mlx`` (the entry point does, first thing)."""
    global _state
    if _state is not None:
        return _state
    if not sys.platform.startswith("linux") or _mlx_on_cuda():
        _state = BlasState(relevant=False)
        return _state
    resolved = _resolved_sgemm()
    if "openblas" in resolved.lower():  # LD_PRELOAD (run.sh, the bundle's hook) or loaded
        how = "preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "loaded"
        _state = BlasState(relevant=True, library=resolved, how=how)
        return _state
    lib = next((p for p in OPENBLAS_OPENMP if os.path.isfile(p)), None)
    if os.environ.get(OPT_OUT) == "1":
        _state = _slow(f"OpenBLAS is turned off ({OPT_OUT}=1), so MLX runs on its slow "
                       "bundled BLAS: prompts take about 20x longer.")
    elif lib is None:
        _state = _slow("MLX is running on its slow bundled BLAS: prompts take about 20x "
                       f"longer. Install OpenBLAS ({INSTALL_HINT}) and restart PagedChat.")
    elif "mlx.core" in sys.modules:
        _state = _slow("OpenBLAS was found but MLX was already loaded, so it runs on its slow "
                       "bundled BLAS: prompts take about 20x longer. Restart PagedChat.")
    else:
        os.environ.setdefault(WAIT_POLICY, "PASSIVE")
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            _state = _slow(f"OpenBLAS could not be loaded ({exc}), so MLX runs on its slow "
                           "bundled BLAS: prompts take about 20x longer.")
        else:
            resolved = _resolved_sgemm()
            _state = (BlasState(relevant=True, library=resolved, how="loaded")
                      if "openblas" in resolved.lower() else
                      _slow(f"{lib} was loaded but MLX's matmul does not resolve to it."))
    return _state


def state() -> BlasState:
    """What ``load()`` found (it runs now if nothing called it yet)."""
    return _state if _state is not None else load()
