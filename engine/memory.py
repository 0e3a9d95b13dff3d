"""How much memory this process may give the KV pool, asked of the OS (or of Metal).

The pool is allocated once, up front, from a user-chosen budget. A budget larger than the
machine can hold does not fail politely: under an address-space limit MLX's allocation
failure killed the process with SIGSEGV, and on a Mac an oversized Metal buffer stalls the
whole system. So the budget is checked here, before anything is allocated, against the
smallest of: physical memory (on a Mac with Metal, Metal's recommended working set, the
most the GPU can use without paging), the process's address-space and data-segment limits
(RLIMIT_AS, RLIMIT_DATA) and a cgroup v2 memory limit.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: The pool may take at most this share of the usable memory: the model's weights, the
#: activations of a step and the app itself need the rest.
MAX_POOL_FRACTION = 0.5
#: What the engine uses when nothing else is chosen (a few dozen chats of a small model).
DEFAULT_BUDGET_MIB = 256.0

_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process can use, and which limit set it (for messages)."""

    bytes: int
    source: str  # e.g. "physical memory", "Metal's recommended working set"
    net_of_mapped: bool = False  # already net of what this process has mapped (weights too)

    @property
    def max_pool_mib(self) -> float:
        return self.bytes * MAX_POOL_FRACTION / 2**20


def usable_memory() -> MemoryLimit:
    """The tightest memory limit that applies to this process (see the module docstring)."""
    limits: list[MemoryLimit] = []
    metal = _metal_working_set()
    if metal:
        limits.append(MemoryLimit(metal, "Metal's recommended working set"))
    physical = _physical_memory()
    if physical:
        limits.append(MemoryLimit(physical, "physical memory"))
    limits.extend(_rlimits())
    cgroup = _cgroup_limit()
    if cgroup:
        limits.append(MemoryLimit(cgroup, "the cgroup memory limit"))
    if not limits:  # an OS that tells nothing: assume a small machine rather than none
        return MemoryLimit(4 * 2**30, "an assumed 4 GiB (the OS reports no memory size)")
    return min(limits, key=lambda limit: limit.bytes)


def check_kv_budget(budget_mib: object, field: str = "kv_memory_mib") -> float:
    """``budget_mib`` as a float if it is a sane KV budget for this machine, else a
    ValueError that names the field, the allowed range and the limit behind it."""
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, int | float):
        raise ValueError(f"{field} must be a number of MiB, got {budget_mib!r}")
    value = float(budget_mib)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be a finite number of MiB above 0, got {budget_mib!r}")
    limit = usable_memory()
    if value > limit.max_pool_mib:
        raise ValueError(
            f"{field} is {value:g} MiB, but this machine allows at most "
            f"{limit.max_pool_mib:.0f} MiB for the KV pool (half of {limit.source}, "
            f"{limit.bytes / 2**30:.1f} GiB): choose a smaller KV memory budget"
        )
    return value


def check_fits(pool_bytes: int, weights_bytes: int) -> None:
    """Refuse (ValueError) a pool that, next to the model's weights, would not fit in
    usable memory; checked once the model is loaded, before the pool is allocated."""
    limit = usable_memory()
    need = pool_bytes + (0 if limit.net_of_mapped else weights_bytes)
    if need > limit.bytes * 0.9:
        raise ValueError(
            f"the KV pool ({pool_bytes / 2**20:.0f} MiB) and the model's weights "
            f"({weights_bytes / 2**20:.0f} MiB) do not fit in {limit.source} "
            f"({limit.bytes / 2**30:.1f} GiB): choose a smaller KV memory budget or a "
            "smaller model"
        )


def _physical_memory() -> int | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    if pages > 0 and page_size > 0:
        return pages * page_size
    return None


def _metal_working_set() -> int | None:
    if sys.platform != "darwin":
        return None
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        size = mx.device_info().get("max_recommended_working_set_size")
    except Exception:  # an MLX without device_info: fall back to physical memory
        return None
    return int(size) if size else None


def _rlimits() -> list[MemoryLimit]:
    try:
        import resource
    except ImportError:  # not on POSIX
        return []
    out = []
    for name, source in (("RLIMIT_AS", "the address-space limit (ulimit -v)"),
                         ("RLIMIT_DATA", "the data-segment limit (ulimit -d)")):
        kind = getattr(resource, name, None)
        if kind is None:
            continue
        soft, _ = resource.getrlimit(kind)
        if soft != resource.RLIM_INFINITY and soft > 0:
            # What is already mapped (libraries, thread stacks, the weights) counts too.
            used = _mapped_bytes() if name == "RLIMIT_AS" else 0
            out.append(MemoryLimit(max(int(soft) - used, 0), source, net_of_mapped=bool(used)))
    return out


def _mapped_bytes() -> int:
    """This process's virtual size (Linux /proc; 0 where unknown)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cgroup_limit() -> int | None:
    try:
        text = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
