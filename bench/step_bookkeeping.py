"""The host's bookkeeping of one step at 64 sequences: scheduler + output, no model.

What the step runner does around the forward for a batch of decoding chats: plan the step
(``Scheduler.decoding``, ``schedule``), ``commit`` it, then for each sampled token
``resolve`` and ``Output.accept_token``, and free what ended. Every ``--churn`` steps one
chat is cancelled and a new one arrives (a removal and an admission). No MLX work: the
allocator is real, the detokenizer and the event queue are stand-ins.

    source scripts/env.sh; .venv/bin/python bench/step_bookkeeping.py [--sequences 64]

Runs against whatever ``engine`` is first on the path, so the code before a change can be
measured with the same script: ``PYTHONPATH=/path/to/old/checkout .venv/bin/python ...``
(it adapts to the older ``Output(scheduler, ...)``, which freed blocks itself).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

if not any(Path(p, "engine", "engine.py").exists() for p in sys.path[1:] if p):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import SamplingParams  # noqa: E402
from engine.events import FinishReason  # noqa: E402
from engine.kv.blocks import BlockAllocator  # noqa: E402
from engine.runner.output import Output  # noqa: E402
from engine.runner.telemetry import Telemetry  # noqa: E402
from engine.sched.scheduler import Scheduler  # noqa: E402
from engine.sched.sequence import Request, Sequence  # noqa: E402


class Detokenizer:
    """A stand-in for mlx-lm's streaming detokenizer: one character per token."""

    def __init__(self) -> None:
        self.text = ""

    def add_token(self, token: int) -> None:
        self.text += chr(65 + token % 26)

    def finalize(self) -> None:
        pass


class Handle:
    def _push(self, event) -> None:
        pass


def new_chat(i: int, prompt_len: int) -> Sequence:
    prompt = [(31 * i + 7 * k) % 30000 + 10 for k in range(prompt_len)]
    request = Request(f"r{i}", f"s{i}", SamplingParams(temperature=0.0, max_tokens=10**6),
                      prompt, handle=Handle())
    seq = Sequence(request, 0, list(prompt), len(prompt), key=None, detokenizer=Detokenizer())
    request.sequences.append(seq)
    return seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--churn", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    alloc = BlockAllocator(16384, 16)
    sched = Scheduler(alloc, max_batch=args.sequences, prefill_chunk=args.sequences * args.prompt)
    telemetry = Telemetry()
    old_api = "scheduler" in inspect.signature(Output).parameters
    output = (Output(sched, telemetry, {0}, 10**6) if old_api
              else Output(telemetry, {0}, 10**6))

    def release() -> None:
        if not old_api:
            for seq in output.take_finished():
                sched.remove(seq)

    def add(seq: Sequence) -> None:
        output.requests[seq.request.request_id] = seq.request
        sched.add(seq)

    made = 0
    for _ in range(args.sequences):
        add(new_chat(made, args.prompt))
        made += 1
    times = []
    for step in range(args.steps):
        if step and step % args.churn == 0:  # one chat cancelled, one arriving
            oldest = next(iter(output.requests.values()))
            output.finish_request(oldest, FinishReason.CANCELLED)
            release()
            add(new_chat(made, args.prompt))
            made += 1
        t0 = time.perf_counter()
        sched.decoding  # noqa: B018 (the runner asks it for the prefill budget)
        plan = sched.schedule()
        sched.commit(plan)
        for work in plan.works:
            if work.want_logits:
                sched.resolve(work.seq, 1 + step % 1000)
                output.accept_token(work.seq, 1 + step % 1000)
        release()
        times.append(time.perf_counter() - t0)
    steady = times[args.steps // 10:]
    q = statistics.quantiles([t * 1e6 for t in steady], n=4)
    print(f"engine from {Path(sys.modules['engine.sched.scheduler'].__file__).parent.parent}")
    print(f"{args.sequences} sequences, a cancel + an arrival every {args.churn} steps: "
          f"median {statistics.median(steady) * 1e6:.1f} us per step "
          f"(q1 {q[0]:.1f}, q3 {q[2]:.1f}; n={len(steady)})")


if __name__ == "__main__":
    main()
