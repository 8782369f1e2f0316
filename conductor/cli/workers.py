"""``conductor worker`` and ``conductor agent``: the processes that claim and run batches, and the
engine flags they (and ``conductor run``) share."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from conductor.cli.args import non_negative_float, positive_float, positive_int
from conductor.cli.connect import conductor_from
from conductor.errors import ConductorError


def engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--engine", choices=["sim", "torch", "trtllm"], default="sim",
                   help="sim: a cost model, no GPU; torch: transformers; trtllm: TensorRT-LLM")
    if model_required:
        p.add_argument("--model", required=True, help="model name (the engine's identity in the conductor)")
    p.add_argument("--model-path", help="torch/trtllm: local model folder (torch: 'tiny' for a random tiny Llama)")
    p.add_argument("--max-batch-size", type=positive_int, default=64, help="items per batch (the contract)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=8192,
                   help="input tokens per batch, padded in memory mode (the contract)")
    p.add_argument("--max-input-len", type=positive_int, default=4096,
                   help="longest input the engine takes; longer items get an error result")
    p.add_argument("--sim-time-scale", type=non_negative_float, default=0.0,
                   help="sim: multiply the cost model's sleeps by this (0: no sleeping)")


def consumer_flags(p: argparse.ArgumentParser, whose: str) -> None:
    """The flags of anything that claims as one consumer (a worker, a host agent): its heartbeat and
    when it exits. ``whose`` names it in the help ("this one's")."""
    p.add_argument("--heartbeat-ttl", type=positive_float, default=10.0,
                   help=f"seconds without a heartbeat before other workers reclaim {whose} batches")
    p.add_argument("--idle-exit", type=non_negative_float,
                   help="exit after this many seconds with nothing to do (default: never)")
    p.add_argument("--max-batches", type=positive_int, help="exit after claiming this many batches (default: no limit)")
    p.add_argument("--create", action="store_true",
                   help="serve the model even if Redis does not know it yet (a fleet started before its first "
                        "submit); without it an unknown model (a typo) is refused")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """make_engine's keyword arguments from the engine flags (plain data: the agent sends them on)."""
    kw: dict[str, Any] = {"model": args.model}
    if args.engine == "sim":
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, time_scale=args.sim_time_scale)
    else:
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, model_path=args.model_path)
    return kw


def build_engine(args: argparse.Namespace) -> Any:  # an engine (conductor.workers.engines.base.Engine)
    from conductor.workers.engines import make_engine
    return make_engine(args.engine, **engine_kwargs(args))


def stop_cleanly_until_ready() -> None:
    """Loading an engine takes up to minutes: a SIGTERM meanwhile (systemd stopping a unit that is
    still starting) ends the start with status 0, as a SIGTERM does once the loop runs, instead of
    death by signal. ``install_signals`` replaces this handler with the draining one."""
    def stop(_sig: int, _frame: object) -> None:
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)


def cmd_worker(args: argparse.Namespace) -> int:
    from conductor.workers.latch import AdmissionLatch, LatchConfigError
    from conductor.workers.worker import Worker, WorkerOptions
    try:
        AdmissionLatch(args.high_water, args.low_water)
    except LatchConfigError as e:
        raise ConductorError(str(e)) from None
    stop_cleanly_until_ready()
    from conductor.cli.admin import known_model
    c = conductor_from(args)
    known_model(c, args.model, args.create)  # before the engine loads: a typo costs no minutes
    engine = build_engine(args)
    if args.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port)
    opts = WorkerOptions(name=args.name or "", high_water=args.high_water, low_water=args.low_water,
                         pending_ceiling=args.pending_ceiling, drain_s=args.drain_s,
                         heartbeat_ttl_s=args.heartbeat_ttl, idle_exit_s=args.idle_exit,
                         max_batches=args.max_batches)
    w = Worker(c, engine, opts)
    w.install_signals()
    w.run()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from conductor.workers.host_agent import HostAgent
    from conductor.workers.worker import WorkerOptions
    if args.engine != "sim" and not args.model_path:
        raise ConductorError(f"--model-path: required with --engine {args.engine}")
    stop_cleanly_until_ready()
    c = conductor_from(args)
    from conductor.cli.admin import known_model
    known_model(c, args.model, args.create)  # also refuses an unreachable Redis before engines load
    opts = WorkerOptions(name=args.name or "", drain_s=args.drain_s, heartbeat_ttl_s=args.heartbeat_ttl,
                         idle_exit_s=args.idle_exit, max_batches=args.max_batches)
    agent = HostAgent(c, {"kind": args.engine, **engine_kwargs(args)}, args.gpus, opts, depth=args.depth,
                      ring_bytes=args.ring_mb << 20)
    agent.install_signals()
    agent.run()
    return 0
