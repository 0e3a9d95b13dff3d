"""``pagedchat batch IN.jsonl -o OUT.jsonl``: an OpenAI batch input file through the pool,
with no window and no Qt.

Every line is validated before the model loads; bad lines are listed with their numbers and
nothing runs unless --skip-bad-lines says to run the others. A progress bar on stderr shows
done / total, tokens/s and the time left. Ctrl+C or SIGTERM stops it with every finished
line kept; running the same command again computes only the lines that are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid

from app.server.batch import BatchInputError, BatchJob, LineError, OutputFile, read_input
from app.server.engine_args import add_engine_args, engine_config

MAX_ERRORS_SHOWN = 20
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedchat batch",
        description="Run an OpenAI batch input file (JSONL: one {custom_id, method, url, body} "
        "per line, /v1/chat/completions or /v1/completions) on PagedChat's engine and write "
        "OpenAI's batch output format. Rerunning after an interruption computes only the "
        "lines that OUT does not hold yet.",
    )
    p.add_argument("input", metavar="IN.jsonl", help="the batch input file")
    p.add_argument("-o", "--output", metavar="OUT.jsonl", required=True,
                   help="the output file (created, or resumed if it holds part of the results)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="run the valid lines even when some are invalid (they are listed)")
    add_engine_args(p)
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="requests handed to the engine at once (default: twice --max-batch, "
                   "so the batch stays full while finished requests are written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def report_errors(source: str, errors: list[LineError]) -> None:
    for error in errors[:MAX_ERRORS_SHOWN]:
        _say(f"{source} {error}")
    if len(errors) > MAX_ERRORS_SHOWN:
        _say(f"... and {len(errors) - MAX_ERRORS_SHOWN} more invalid lines")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    concurrency = args.concurrency if args.concurrency is not None else 2 * args.max_batch
    if concurrency < 1 or args.max_batch < 1:
        _say("pagedchat batch: --concurrency and --max-batch must be >= 1")
        return EXIT_BAD_INPUT
    try:
        lines, errors = read_input(args.input)
        output = OutputFile(args.output)
        done = output.load({line.custom_id for line in lines})
    except BatchInputError as exc:
        _say(f"pagedchat batch: {exc}")
        return EXIT_BAD_INPUT
    if errors:
        report_errors(args.input, errors)
        if not args.skip_bad_lines:
            _say(f"pagedchat batch: {len(errors)} invalid line(s); nothing was run. Fix them, "
                 "or pass --skip-bad-lines to run the other lines.")
            return EXIT_BAD_INPUT
        _say(f"pagedchat batch: skipping {len(errors)} invalid line(s)")
    if not lines:
        _say("pagedchat batch: no valid line to run")
        return EXIT_BAD_INPUT
    if len(done) == len(lines):
        _say(f"pagedchat batch: {args.output} already holds all {len(lines)} results; "
             "nothing to do")
        return 0

    from app.server.batch import check_models
    from engine import Engine

    try:
        config = engine_config(args)
    except ValueError as exc:
        _say(f"pagedchat batch: {exc}")
        return EXIT_BAD_INPUT
    engine = Engine(config)
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    job: BatchJob | None = None
    try:
        _say(f"Loading {args.model} ...")
        engine.start()
        if not engine.wait_ready():
            _say(f"pagedchat batch: the model did not load: {engine.load_error}")
            return 1
        lines, wrong = check_models(lines, engine, ("default", args.model))
        if wrong:
            report_errors(args.input, wrong)
            if not args.skip_bad_lines:
                _say(f"pagedchat batch: {len(wrong)} line(s) ask for another model; nothing "
                     "was run. Fix them, or pass --skip-bad-lines to run the other lines.")
                return EXIT_BAD_INPUT
        job = BatchJob(lines, output, engine, session_id=f"batch:{uuid.uuid4().hex[:8]}",
                       concurrency=concurrency)
        progress = asyncio.run(_run(job, show=not args.no_progress))
    except KeyboardInterrupt:
        if job is not None:
            _say(f"pagedchat batch: interrupted with {job.progress.done} of {len(lines)} lines "
                 f"in {args.output}; run the same command again to finish")
        return EXIT_INTERRUPTED
    finally:
        engine.stop()
        signal.signal(signal.SIGTERM, previous_term)
    failed = f", {progress.failed} failed (their errors are in the output)" \
        if progress.failed else ""
    _say(f"pagedchat batch: {len(lines)} lines in {args.output}: {job.computed} computed, "
         f"{progress.resumed} already there{failed}; {progress.tokens} tokens in "
         f"{progress.elapsed:.1f}s ({progress.tokens_per_s:.1f} tok/s)")
    return 0


async def _run(job: BatchJob, show: bool):
    from tqdm import tqdm

    bar = tqdm(total=job.progress.total, unit="line", file=sys.stderr, disable=not show,
               dynamic_ncols=True, smoothing=0.1)

    def update(progress) -> None:
        if bar.n == 0 and progress.resumed:
            bar.initial = progress.resumed  # tqdm's rate and time left count this run only
        bar.n = progress.done
        bar.set_postfix_str(f"{progress.tokens_per_s:.1f} tok/s"
                            + (f", {progress.failed} failed" if progress.failed else ""),
                            refresh=False)
        bar.refresh()

    job.on_progress = update
    try:
        return await job.run()
    finally:
        bar.close()
