"""The GPU check (scripts/gpu/check_engine.py) runs in CI too, on the CPU at tiny sizes.

On the H200 it is the gate for engine changes (docs/GPU.md); here it keeps its checks
honest: every one of them runs against mlx-lm's reference and must pass on the CPU backend,
so a check that broke (or an engine change that breaks one) shows before anyone pays for GPU
time.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu" / "check_engine.py"


def load_check():
    spec = importlib.util.spec_from_file_location("check_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_passes_on_the_cpu_at_quick_sizes(tmp_path, capsys) -> None:
    check = load_check()
    out = tmp_path / "check.json"
    assert check.main(["--quick", "--json", str(out)]) == 0, capsys.readouterr().out
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("gpu-check: PASS"), summary
    import json

    outcome = json.loads(out.read_text())
    assert not outcome["failed"]
    names = " ".join(outcome["passed"])
    for expected in ("prompt 17 greedy", "prefix cache hit counted", "n=3 greedy sample 2",
                     "preemption happened", "cancel mid-prefill generated nothing",
                     "stop string ends the reply with stop", "app-defaults",
                     "[disk reference int8] every full block read back"):
        assert expected in names, f"the check {expected!r} did not run"


def test_a_wrong_greedy_token_fails_the_check_unless_the_reference_had_a_tie() -> None:
    check = load_check()
    results = check.Results()
    check.compare_greedy(results, "clear", [1, 2, 9], [1, 2, 3], [0.5, 0.5, 0.5])
    check.compare_greedy(results, "tie", [1, 2, 9], [1, 2, 3], [0.5, 0.5, 1e-5])
    check.compare_greedy(results, "short", [1, 2], [1, 2, 3], [0.5, 0.5, 0.5])
    assert [f.split(":")[0] for f in results.failed] == ["clear", "short"]
    assert results.passed == ["tie"] and results.tie_flips
