"""``conductor run``: the main job in one command: submit FILE, run N workers per model, write
the results, and leave nothing behind.

* A fresh run unless told to resume: a job name this Redis knows is never silently continued.
  The default name (the file's) takes the first free ``NAME-2``, ``NAME-3``, ... and says so; a
  ``--job`` that exists is refused unless ``--resume``, and a resume with other engine or
  contract options than the job ran with is refused (they are kept in the job's meta hash,
  field ``run``), since its results so far came from those.
* Process hygiene: every child (the workers, the embedded redis-server) leads a process group of
  its own and gets SIGTERM from the kernel if this process dies (``embedded.tie_to_parent``). On
  SIGINT, SIGTERM or SIGHUP the workers are stopped (in-flight batches finish or go back within
  ``WORKER_DRAIN_S``), the results completed so far are read out, the embedded server is stopped,
  and the command exits 128 + the signal's number (130, 143, 129) within about two seconds.
* The output is written under a temporary name and moved into place once everything that
  completed is in it (conductor/cli/output.py). A stopped run leaves an earlier OUT as it was: its
  part goes beside it (``OUT.partial.jsonl``, named on stderr), with the command that finishes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from conductor.cli.output import Output, beside, refuse_overwrite
from conductor.cli.run_summary import RunSummary
from conductor.cli.submit import default_job, job_class, rejects_output
from conductor.errors import ConductorError

if TYPE_CHECKING:
    from conductor.cli.progress import ProgressLine

# What a job's results depend on: a resume with other values would mix two kinds of answers.
RUN_OPTIONS = ("engine", "model_path", "max_batch_size", "max_batch_tokens", "max_input_len")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WORKER_DRAIN_S = 0.2  # a stopped run's workers finish or hand back their batches within this
STOP_WAIT_S = 1.0  # then whatever still runs is killed: the whole stop stays within about 2 s


class Interrupted(KeyboardInterrupt):
    """A stop signal before anything was started; the command exits 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopFlag:
    """Set by the first stop signal once children run: the main loop stops them in order."""

    def __init__(self) -> None:
        self.signum = 0
        self.at = 0.0

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        if not self.signum:
            self.signum, self.at = signum, time.monotonic()

    def __bool__(self) -> bool:
        return self.signum != 0


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _handle(handler: Any) -> dict[int, Any]:
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the job's results depend on, as the workers run it: a contract flag left out is the value it
    defaults to, or None where the engine chooses (vllm, openai)."""
    from conductor.cli.workers import contract_value
    return {k: contract_value(args, k) for k in RUN_OPTIONS}


def _shown(opts: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {'(the engine default)' if v is None else v}" for k, v in opts.items())


def choose_job(c: Any, args: argparse.Namespace) -> str:
    """The job this run fills: see the module's docstring."""
    from conductor.redis_contract import keys as K
    from conductor.redis_contract.connection import as_str
    job = args.job or default_job(args.file)

    def exists(name: str) -> bool:
        return c.r.zscore(K.JOBS_KEY, name) is not None
    if not exists(job):
        if args.resume:
            print(f"job {job} is new to this Redis: nothing to resume, a fresh run", file=sys.stderr)
        return job
    if args.resume:
        stored = c.r.hget(K.job_meta_key(job), "run")
        ran = json.loads(as_str(stored)) if stored else None
        now = run_options(args)
        if ran is not None and ran != now:
            differ = {k: v for k, v in now.items() if ran.get(k) != v}
            raise ConductorError(f"job {job} ran with {_shown({k: ran.get(k) for k in differ})}; this resume asks "
                                 f"{_shown(differ)}: its results so far came from the first. Resume with the same "
                                 "options, or run without --resume for a fresh job")
        return job
    st = c.status(job)
    if args.job:
        raise ConductorError(f"job {job} exists in this Redis ({st['submitted']} items, "
                             f"{st['completed'] + st['failed']} answered): --resume continues it, --job NEW "
                             "starts a fresh one; nothing done")
    for k in range(2, 100_000):
        fresh = f"{job[:96]}-{k}"
        if not exists(fresh):
            print(f"job {job} exists in this Redis: this run is job {fresh} (--job {job} --resume continues "
                  f"{job})", file=sys.stderr)
            return fresh
    raise ConductorError(f"job {job} and its numbered successors all exist: name one with --job")


def _worker_cmd(args: argparse.Namespace, url: str, model: str, i: int, port: int) -> list[str]:
    store = ["--store", args.store] if args.store else []  # else CONDUCTOR_STORE, inherited
    cmd = [sys.executable, "-m", "conductor", "--redis", url, *store, "--log-level", "warning", "worker",
           "--engine", args.engine, "--model", model, "--name", f"run-{model}-{i}",
           "--sim-time-scale", str(args.sim_time_scale), "--metrics-port", str(port), "--drain-s", str(WORKER_DRAIN_S)]
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--max-batch-tokens", args.max_batch_tokens),
                        ("--max-input-len", args.max_input_len), ("--model-path", args.model_path),
                        ("--endpoint", args.endpoint), ("--served-model", args.served_model),
                        ("--max-in-flight", args.max_in_flight)):
        if value is not None:
            cmd += [flag, str(value)]
    for key, value in args.engine_arg or ():
        cmd += ["--engine-arg", f"{key}={json.dumps(value)}"]
    return cmd


def worker_env(engine: str, i: int, n: int) -> dict[str, str] | None:
    """The environment of run's worker ``i`` of ``n``: vLLM engines of one host split it. On CPU each
    takes its share of this process's cores (vLLM's automatic binding would put every engine on the
    same ones); with GPUs, one each (CUDA_VISIBLE_DEVICES). Whatever the caller set stays."""
    if engine != "vllm":
        return None
    env = dict(os.environ)
    # run prints its own progress and summary; vLLM's lines would drown them (its warnings at start,
    # its monitor's "engine core exited unexpectedly" when run stops the worker's process group, the
    # interpreter's shared-memory notice at exit): a user who wants them sets these variables
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.setdefault("PYTHONWARNINGS", "ignore")
    gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if n > 1 and (gpus or _has_cuda()):  # as the host agent places its GPU processes
        env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)] if gpus else str(i)
    elif n > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        share = cores[i * len(cores) // n:(i + 1) * len(cores) // n] or [cores[i % len(cores)]]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
    return env


def _has_cuda() -> bool:
    import shutil
    return shutil.which("nvidia-smi") is not None


class _Workers:
    """The run's worker processes, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.stopped_at = 0.0

    def start(self, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        from conductor.embedded import tie_to_parent
        self.ports.append(port)
        self.procs.append(subprocess.Popen(cmd, preexec_fn=tie_to_parent(), env=env))

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        """SIGTERM once: each drains (WORKER_DRAIN_S) and exits."""
        if not self.stopped_at:
            self.stopped_at = time.monotonic()
            self._signal(signal.SIGTERM)

    def finish(self, wait_s: float) -> None:
        """Stopped, and gone within ``wait_s``: what still runs then is killed."""
        self.stop()
        deadline = self.stopped_at + wait_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()


def cmd_run(args: argparse.Namespace) -> int:
    """See the module's docstring."""
    from conductor.intake.file_intake import check_file
    refuse_overwrite([args.file], {"-o": args.output, "--rejects": args.rejects})
    before = _handle(_raise_interrupted)  # nothing started yet: a signal simply ends the command
    try:
        with rejects_output(args.rejects) as rej:
            found = check_file(args.file, skip_invalid=args.skip_invalid, rejects=rej)
        stop = _StopFlag()
        _handle(stop.handler)  # from here on children may run: a signal stops them in order
        return _run(args, found, stop)
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def _run(args: argparse.Namespace, found: Any, stop: _StopFlag) -> int:  # noqa: C901 - the lifecycle, in order
    from conductor.embedded import EmbeddedRedis
    server = None
    url = args.redis or os.environ.get("CONDUCTOR_REDIS_URL")
    if url:
        print(f"using Redis at {url}", file=sys.stderr)
    else:
        server = EmbeddedRedis(die_with_parent=True).start()
        url = server.url
        print(f"using an embedded redis-server on {url} for this run (pass --redis URL to use yours)",
              file=sys.stderr)
    workers = _Workers()
    out: Output | None = None
    try:
        if stop:
            return _interrupted(stop, args, None, 0, None)
        from conductor.client import Conductor
        from conductor.tier.object_store import store_from
        c = Conductor.from_url(url, store=store_from(args.store))
        job = choose_job(c, args)
        from conductor.intake.file_intake import prepare_job
        prepare_job(c, found, job, job_class(args, c, job))
        from conductor.jobs.job_state import start
        start(c.r, job, run=json.dumps(run_options(args)))
        from conductor.cli.submit import record_input
        record_input(c, job, args.file)  # for its ledger and retry (conductor verify-job, retry)
        # An earlier output stays whole when this run is stopped: the part goes beside it (docs/cli.md).
        earlier = os.path.isfile(args.output)
        out = Output(args.output)
        summary, t0 = _serve(args, c, found, job, stop, workers, url, out)
        written = beside(args.output) if stop and earlier else args.output
        out.commit(to=written)
        if stop:
            return _interrupted(stop, args, c, summary.results, None if server else url, job, written)
        return _finish(args, c, job, summary, t0)
    except BaseException:
        if out is not None:
            out.discard()
        raise
    finally:
        workers.finish(STOP_WAIT_S if stop else 30.0)
        if server:
            server.close()


def _serve(args: argparse.Namespace, c: Any, found: Any, job: str, stop: _StopFlag, workers: _Workers, url: str,
           out: Output) -> tuple[RunSummary, float]:
    """Start the workers, send the file, and write the results as they come; on a stop signal, stop
    the workers and read out what completed. Returns what was written and when the work began."""
    from conductor.cli.progress import ProgressLine
    from conductor.embedded import free_port
    from conductor.intake.file_intake import send_file
    models = sorted(found.counts)
    if args.quiet_ms is not None:
        for m in models:
            c.set_config(m, {"quiet_ms": args.quiet_ms})
    for m, i in ((m, i) for m in models for i in range(args.workers)):
        if not stop:
            port = free_port()
            workers.start(_worker_cmd(args, url, m, i, port), port, worker_env(args.engine, i, args.workers))
    t0 = time.monotonic()
    rep = send_file(c, found, job, should_stop=lambda: bool(stop))
    if not stop:
        print(f"job {job}: {rep.accepted} items submitted ({rep.duplicates} already there), "
              f"{len(models)} model(s), {args.workers} worker(s) each", file=sys.stderr)
    summary = RunSummary()
    reads_after_exit = 0

    def should_stop() -> bool:
        """Asked after each empty read: done once the workers are gone and one more read found nothing."""
        nonlocal reads_after_exit
        if stop:
            workers.stop()
            if not workers.all_exited() and time.monotonic() - workers.stopped_at < STOP_WAIT_S:
                return False
        elif not workers.all_exited():
            return False
        reads_after_exit += 1
        return reads_after_exit > 1
    with ProgressLine(f"job {job}", found.items, sys.stderr, unit="results") as line:
        _collect(c.results(job, follow=True, block_ms=100, should_stop=should_stop), out, summary, line, stop,
                 workers)
    if not stop:
        summary.scrape_workers(workers.ports)
    return summary, t0


def _collect(records: Iterator[bytes], out: Output, summary: RunSummary, line: ProgressLine, stop: _StopFlag,
             workers: _Workers) -> None:
    shown = 0.0
    for rec in records:
        out.write(rec + b"\n")
        summary.add(rec)
        now = time.monotonic()
        if stop:
            workers.stop()
            if now - stop.at > STOP_WAIT_S + 0.3:
                break  # results still pour in: what is written is what completed by now
        if now - shown >= 0.1:  # the line redraws a few times a second; per result is waste
            shown = now
            line.update(summary.results)
    line.update(summary.results)


def _finish(args: argparse.Namespace, c: Any, job: str, summary: RunSummary, t0: float) -> int:
    n = summary.results
    st = c.status(job)
    dt = time.monotonic() - t0
    print(f"job {job}: {st['completed']} completed, {st['failed']} failed, {st['pending']} pending; "
          f"{n} results in {args.output}; {dt:.2f}s ({n / dt if dt else 0:.0f} results/s)", file=sys.stderr)
    print(f"job {job}: {summary.text()}", file=sys.stderr)
    return 0 if st["pending"] == 0 else 1


def _interrupted(stop: _StopFlag, args: argparse.Namespace, c: Any, n: int, url: str | None, job: str = "",
                 written: str = "") -> int:
    """The stop's one line: what was written where, and the command that goes on (``url`` None: the
    embedded Redis, gone with the run, so a rerun starts over)."""
    name = signal.Signals(stop.signum).name
    if c is None:
        print(f"conductor: stopped by {name} before the job started; nothing written", file=sys.stderr)
        return 128 + stop.signum
    st = c.status(job)
    kept = f" ({args.output} kept as it was)" if written != args.output else ""
    if url is None:
        later = (f"the embedded Redis went with this run, and the job with it: a rerun starts over: "
                 f"{rerun_command(args, None, None)}; pass --redis URL (a Redis of yours) for a run you can resume")
    else:
        later = f"to finish it: {rerun_command(args, job, url)}"
    print(f"conductor: stopped by {name}: {n} results written to {written}{kept}, {st['pending']} of "
          f"{st['submitted']} items not done; {later}", file=sys.stderr)
    return 128 + stop.signum


def rerun_command(args: argparse.Namespace, job: str | None, url: str | None) -> str:
    """This run's command line as typed, with ``-o``, ``--redis URL`` and (``job`` given) ``--job J
    --resume`` put in place: pasted into the same folder, it continues the job (or repeats the run)."""
    from conductor.redis_contract.connection import redact_url
    takes_value = {"--job", "-o", "--output", "--redis"}
    typed = list(getattr(args, "argv", None) or ["run", args.file])
    kept: list[str] = []
    skip = False
    for tok in typed:
        if skip:
            skip = False
        elif tok in takes_value:
            skip = True
        elif tok != "--resume" and not tok.startswith(tuple(f"{o}=" for o in takes_value)) and \
                not (tok.startswith("-o") and not tok.startswith("--")):
            kept.append(tok)
    cmd = [*_program(), *kept, "-o", args.output]
    if url is not None:
        cmd += ["--redis", redact_url(url)]
    if job is not None:
        cmd += ["--job", job, "--resume"]
    text = shlex.join(cmd)
    return text + (" (the password elided: put it back)" if url is not None and redact_url(url) != url else "")


def _program() -> list[str]:
    """How this command was started, as a shell would run it again."""
    import shutil
    first = sys.argv[0] if sys.argv else ""
    if os.path.basename(first) == "conductor":
        found = shutil.which("conductor")
        if found and os.path.exists(first) and os.path.samefile(found, first):
            return ["conductor"]
        return [first]
    return [sys.executable, "-m", "conductor"]
