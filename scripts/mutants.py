"""Plant known defects one at a time and check that the tests meant to catch them fail.

A green suite says little unless its tests fail when the feature breaks. Each mutant below
is a defect a real change could bring (a sampler that ignores temperature, a cancel that
keeps its blocks, a pane that shows another pane's tokens, ...), written as an exact text
replacement in one source file, with the tests that claim to guard against it. The script
applies each in a throw-away git worktree of HEAD (the checkout itself is never touched),
runs those tests there, and reports CAUGHT when they fail and SURVIVED when they pass.
Exit status 1 if any survived or no longer applies (its text moved: update the mutant).

    source scripts/env.sh; .venv/bin/python scripts/mutants.py [name-substring ...]

The kernel tests plant their own bugs in the shader text (tests/test_kernel_emulation.py,
tests/test_cuda_kernel.py); this list covers the Python side.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (exact text, its replacement), each found once
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("the gathered prefill lets a query see its own slot's successor",
           "engine/attention/dispatch.py",
           (("visible = slots <= last[:, None]", "visible = slots <= last[:, None] + 1"),),
           ("tests/test_attention.py",)),
    Mutant("the gathered prefill's later tiles forget where they start",
           "engine/attention/dispatch.py",
           (("last = positions[start:start + tile]", "last = positions[:tile]"),),
           ("tests/test_attention.py",)),
    Mutant("the gathered prefill attends at the step's table width, not the warmed one",
           "engine/attention/dispatch.py",
           (("return power_of_two_at_least(length), power_of_two_at_least(table_blocks)",
             "return power_of_two_at_least(length), table_blocks"),),
           ("tests/test_attention.py",)),
    Mutant("the prefill budget probes past its knee only where the line offers no more",
           "engine/sched/prefill_budget.py",
           (("if knee and self._free_run >= self._probe_after:",
             "if knee and fits <= knee and self._free_run >= self._probe_after:"),),
           ("tests/test_prefill_budget.py",)),
    Mutant("each step's time is counted from its own launch, not the last step's end",
           "engine/runner/step.py",
           (("period = done - max(shape.started, self._last_done)",
             "period = done - shape.started"),),
           ("tests/test_step_costs.py",)),
    Mutant("the sampler ignores temperature", "engine/runner/sampling.py",
           (("scaled.append(logprobs * (1.0 / temperature))", "scaled.append(logprobs)"),),
           ("tests/test_sampling.py",)),
    Mutant("the sampler ignores top_k", "engine/runner/sampling.py",
           (("logprobs = apply_top_k(logprobs, top_k)", "logprobs = logprobs"),),
           ("tests/test_sampling.py",)),
    Mutant("the repetition penalty is ignored", "engine/runner/sampling.py",
           (("[[p.repetition_penalty if q else 1.0]", "[[1.0 if q else 1.0]"),),
           ("tests/test_sampling.py",)),
    Mutant("the repetition penalty's window is always mlx-lm's 20 tokens",
           "engine/runner/sampling.py",
           (("self.width = max((p.repetition_context_size for p, q in",
             "self.width = max((20 for p, q in"),),
           ("tests/test_sampling.py",)),
    Mutant("seeded rows draw from the shared key, not their own streams",
           "engine/runner/sampling.py",
           (("self.keyed = [i for i in order if rows[i].key is not None]",
             "self.keyed = []"),
            ("self.shared = [i for i in order if rows[i].key is None]",
             "self.shared = order")),
           ("tests/test_sampling_batched.py",)),
    Mutant("the penalty's carried window never takes the new token", "engine/runner/sampling.py",
           (("windows = mx.concatenate([windows[:, 1:], tokens[:, None]], axis=1)",
             "windows = windows"),),
           ("tests/test_sampling_batched.py", "tests/test_overlap_sampling.py")),
    Mutant("a window rebuilt while its token is in flight leaves that token out",
           "engine/runner/carry.py",
           (("        if s.inflight:  # its newest token is still on the device",
             "        if False:"),),
           ("tests/test_overlap_sampling.py",)),
    Mutant("overlap is off for penalised rows (sampling parameters force a synchronous step)",
           "engine/runner/step.py",
           (("            if not self.overlap:\n                self._end_inflight()",
             "            if not self.overlap or any(s.request.params.repetition_penalty != 1.0\n"
             "                                       for s in launched.seqs):\n"
             "                self._end_inflight()"),),
           ("tests/test_overlap_sampling.py",
            "tests/test_engine.py::test_overlapped_steps_equal_the_synchronous_path")),
    Mutant("a step rerun late takes back the keys the next step moved on",
           "engine/runner/carry.py",
           (("    if number >= seq.key_from:", "    if True:"),),
           ("tests/test_overlap_sampling.py::"
            "test_a_step_rerun_after_the_next_was_launched_keeps_every_stream",)),
    Mutant("steps never overlap", "engine/runner/step.py",
           (("        self.overlap = overlap\n", "        self.overlap = False\n"),),
           ("tests/test_engine.py::test_overlapped_steps_equal_the_synchronous_path",)),
    Mutant("resolving a token forgets the next one in flight (every other step is empty)",
           "engine/sched/scheduler.py",
           (("seq.inflight = max(0, seq.inflight - 1)", "seq.inflight = 0"),),
           ("tests/test_overlap_sampling.py",)),
    Mutant("the batch is serialised: one sequence decodes per step", "engine/sched/scheduler.py",
           (("            if seq.seq_id not in self.running or seq.num_to_feed != 1:\n",
             "            if seq.seq_id not in self.running or seq.num_to_feed != 1"
             " or scheduled:\n"),),
           ("tests/test_engine.py::"
            "test_eight_chats_arriving_at_different_times_match_their_solo_runs",)),
    Mutant("no copy-on-write of a shared partial block", "engine/kv/blocks.py",
           (("                if self._refcount[block] > 1:\n                    copies.append",
             "                if False:\n                    copies.append"),),
           ("tests/test_engine.py::test_fork_after_prompt_copies_the_shared_partial_block",)),
    Mutant("a cancelled request keeps its blocks", "engine/runner/output.py",
           (("        self.finished.append(seq)\n        seq.state = SequenceState.FINISHED",
             "        if reason != FinishReason.CANCELLED:\n"
             "            self.finished.append(seq)\n"
             "        seq.state = SequenceState.FINISHED"),),
           ("tests/test_engine.py::"
            "test_cancel_frees_blocks_at_once_and_deleted_session_ends_cancelled",)),
    Mutant("tokens go to the first pane and a session takes any request's tokens",
           "app/chat/session.py",
           (("        session = self.sessions.get(session_id)\n        if session is not None:\n"
             "            session.on_token(",
             "        session = next(iter(self.sessions.values()), None)\n"
             "        if session is not None:\n            session.on_token("),
            ("        ids = self._requests.get(request_id)\n        if ids is None or not 0 <= "
             "index < len(ids) or ids[index] is None:\n            return  # not ours",
             "        ids = next(iter(self._requests.values()), None)\n        if ids is None or "
             "not 0 <= index < len(ids) or ids[index] is None:\n            return  # not ours")),
           ("tests/test_app_chat.py::test_two_panes_stream_at_the_same_time",)),
    Mutant("the save timer never fires", "app/chat/session.py",
           (("self._save_timer.setInterval(SAVE_INTERVAL_MS)",
             "self._save_timer.setInterval(10**8)"),),
           ("tests/test_app_persistence.py::"
            "test_a_kill_loses_only_the_text_streamed_since_the_last_save_tick",)),
    Mutant("the render throttle never renders", "app/chat/throttle.py",
           (("                c.flush_render()", "                pass"),),
           ("tests/test_app_units.py::"
            "test_throttle_renders_about_30_times_a_second_on_a_controlled_clock",
            "tests/test_app_units.py::test_throttle_flushes_on_the_real_qt_timer")),
)


def _run(mutant: Mutant, tree: Path) -> str:
    path = tree / mutant.path
    original = path.read_text(encoding="utf-8")
    text = original
    for old, new in mutant.edits:
        if text.count(old) != 1:
            return "NO LONGER APPLIES"
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
            cwd=tree, capture_output=True, text=True, timeout=1800)
    finally:
        path.write_text(original, encoding="utf-8")
    failed = [line[7:] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    if run.returncode == 1:
        return f"CAUGHT by {failed[0] if failed else mutant.tests[0]}"
    return "SURVIVED" if run.returncode == 0 else f"ERROR (pytest exit {run.returncode})"


def main(only: list[str]) -> int:
    chosen = [m for m in MUTANTS if not only or any(o in m.name for o in only)]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="pagedchat-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"],
                       cwd=ROOT, check=True)
        try:
            (tree / ".venv").symlink_to(ROOT / ".venv")
            for m in chosen:
                verdict = _run(m, tree)
                bad += not verdict.startswith("CAUGHT")
                print(f"{m.name} ({m.path}): {verdict}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
