"""Launch plans kept by shape, bounded: what lets an engine step's layers only pass arrays.

Planning a kernel call (validation, geometry, kernel objects: engine/attention/plans.py) costs
tens of microseconds, and a step attends once per layer; both backends (engine/attention/metal.py,
engine/attention/cuda.py) therefore plan once per shape key and keep the plan here. The step's
shapes are bucketed (engine/runner/step_batch.py), so a steady decode hits one key; the cache is
an LRU so a server that sees every prompt length does not grow it for ever.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from engine.attention.plans import KernelSet, Launch, Ref

#: Plans a backend keeps (least recently used dropped first). A steady decode uses one or
#: two keys (engine/runner/step_batch.py buckets the shapes); the bound stops a server that sees
#: every prompt length from growing the cache for ever.
PLAN_CACHE_SIZE = 128


@dataclass(frozen=True)
class BoundLaunch:
    """A launch with its kernel object and everything but the arrays: each input is the
    index of an argument of the call, or a ``Ref`` to an earlier launch's output."""

    kernel: object  # the mx.fast kernel
    inputs: tuple  # int (argument index) | Ref
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


class PlanCache:
    """A backend's launch plans by shape key, bounded (LRU), each planned once.

    Planning (validation, geometry, kernel objects) costs tens of microseconds and an engine
    step attends once per layer, so a step would pay it tens of times; cached, a call only
    passes its arrays. The key is the call's shapes and dtypes, not its values: every array
    the plan reads is an argument of the call."""

    def __init__(self, kernels: KernelSet, size: int = PLAN_CACHE_SIZE) -> None:
        self.kernels = kernels
        self.size = size
        self._plans: OrderedDict[tuple, list[BoundLaunch]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def keys(self) -> list[tuple]:
        return list(self._plans)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def run(self, key: tuple, args: tuple, plan: Callable[[], list[Launch]]) -> mx.array:
        """Output 0 of the last launch of the plan for ``key`` (``plan()`` builds it, from
        the arrays in ``args``, the first time), run on ``args``."""
        with self._lock:  # engines on other threads share the cache
            bound = self._plans.get(key)
            if bound is not None:
                self._plans.move_to_end(key)
        if bound is None:
            bound = self._bind(plan(), args)
            with self._lock:
                self._plans[key] = bound
                while len(self._plans) > self.size:
                    self._plans.popitem(last=False)
        results: list[list[mx.array]] = []
        for launch in bound:
            inputs = [results[x.launch][x.output] if isinstance(x, Ref) else args[x]
                      for x in launch.inputs]
            results.append(launch.kernel(
                inputs=inputs, template=launch.template, grid=launch.grid,
                threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                output_dtypes=launch.output_dtypes,
            ))
        return results[-1][0]

    def _bind(self, plan: list[Launch], args: tuple) -> list[BoundLaunch]:
        def index(x) -> int | Ref:
            if isinstance(x, Ref):
                return x
            for i, a in enumerate(args):
                if x is a:
                    return i
            raise ValueError("a plan reads an array that is not an argument of the call: "
                             "it cannot be cached by shape")

        return [
            BoundLaunch(self.kernels.get(x.kernel), tuple(index(i) for i in x.inputs),
                        list(x.template), x.grid, x.threadgroup,
                        [list(o) for o in x.output_shapes], list(x.output_dtypes))
            for x in plan
        ]


def plan_key(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
             context_lens: mx.array) -> tuple:
    """What a plan depends on: the shapes and dtypes of the call's arrays (never their
    values), so a call that would fail ``checked_call`` never shares a checked one's plan."""
    return (q.shape, q.dtype, k_pool.shape, k_pool.dtype, v_pool.shape, v_pool.dtype,
            block_tables.shape, context_lens.shape)
