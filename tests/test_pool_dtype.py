"""The pool's element type follows the model's weights, and every figure sized by it follows.

A tiny random llama saved in bf16 and in fp16 (as mlx_lm.convert saves them) must get a bf16 /
fp16 pool, whatever the compute dtype the default model was given: half the bytes per block
of the fp32 model, so twice the blocks for the same KV budget, in ModelInfo, in the
snapshots and in the monitor's MiB figure.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from engine import Engine, EngineConfig
from tests.reference import reference_model
from tests.tiny_model import CONFIG, make_tiny_model

BLOCK_SIZE = 8
BUDGET_MIB = 1.0
#: K and V of one token in every layer, per byte of the element type.
SLOTS_PER_TOKEN = 2 * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"] * CONFIG[
    "head_dim"]


def loaded(folder: Path) -> Engine:
    engine = Engine(EngineConfig(model=str(folder), kv_memory_mib=BUDGET_MIB,
                                 block_size=BLOCK_SIZE))
    engine.start()
    assert engine.wait_ready(300), engine.load_error
    return engine


@pytest.mark.parametrize("dtype,name,size", [(mx.bfloat16, "bfloat16", 2),
                                             (mx.float16, "float16", 2),
                                             (mx.float32, "float32", 4)])
def test_pool_dtype_and_bytes_per_block_follow_the_weights(tmp_path, dtype, name, size):
    folder = make_tiny_model(tmp_path / name, reference_model().path, dtype=dtype)
    engine = loaded(folder)
    try:
        info = engine.model_info
        snap = engine.snapshot()
        pool_dtypes = {a.dtype for a in engine.runtime.pool.keys + engine.runtime.pool.values}
    finally:
        engine.stop()
    assert pool_dtypes == {dtype}
    assert info.kv_dtype == name
    per_block = SLOTS_PER_TOKEN * size * BLOCK_SIZE
    assert info.bytes_per_block == per_block
    assert info.num_blocks == int(BUDGET_MIB * 2**20 // per_block)
    assert (snap.bytes_per_block, snap.num_blocks, snap.kv_dtype) == (per_block,
                                                                      info.num_blocks, name)


def test_monitor_mib_figure_follows_a_bf16_pool(tmp_path, qtbot, qasync_loop, app_env):
    """The monitor's summary sizes the pool from the bf16 snapshot: blocks x bytes per block,
    named with its dtype (the same budget an fp32 model would split into half the blocks)."""
    from app.monitor.counters import MIB, fmt_mib
    from tests.app_helpers import WAIT_MS, open_window

    folder = make_tiny_model(tmp_path / "bf16", reference_model().path, dtype=mx.bfloat16)
    engine = loaded(folder)
    h = open_window(qtbot, app_env, engine)
    try:
        panel = h.window.monitor_dock.widget()
        qtbot.waitUntil(lambda: panel.summary.text() != "", timeout=WAIT_MS)
        snap = engine.snapshot()
        assert snap.bytes_per_block == SLOTS_PER_TOKEN * 2 * BLOCK_SIZE
        assert fmt_mib(snap.num_blocks * snap.bytes_per_block / MIB) in panel.summary.text()
        assert f"{snap.num_blocks:,} ×" in panel.summary.text()
        assert "bfloat16" in panel.summary.toolTip()
    finally:
        h.close()
        engine.stop()
