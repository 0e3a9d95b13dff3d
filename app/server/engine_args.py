"""The engine's command-line options, one definition for ``pagedchat serve`` and
``pagedchat batch`` (their defaults and help must not drift apart)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="SPEC", default="default",
                   help="'default' (embedded SmolLM2), a local mlx-lm folder or a Hugging Face "
                   "repo id")
    p.add_argument("--kv-memory-mib", type=float, default=256.0, metavar="MIB",
                   help="KV pool budget (default 256)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="most sequences decoded in one step (default 16)")
    p.add_argument("--kv-disk-cache", metavar="DIR", default=None,
                   help="keep full KV blocks in this folder across evictions and restarts, so "
                   "a long prompt seen before (an agent's system prompt) is read back instead "
                   "of prefilled (default: off)")
    p.add_argument("--kv-disk-budget-mib", type=float, default=4096.0, metavar="MIB",
                   help="the most the disk cache takes (default 4096)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The options as an ``EngineConfig``; a ValueError names a bad one. The engine is
    imported here, not at the top: parsing and validating a command loads no MLX."""
    from engine import EngineConfig

    return EngineConfig(model=args.model, kv_memory_mib=args.kv_memory_mib,
                        max_batch=args.max_batch,
                        disk_cache_dir=getattr(args, "kv_disk_cache", None),
                        disk_budget_mib=getattr(args, "kv_disk_budget_mib", 4096.0))
