"""``conductor worker`` and ``conductor agent``: the processes that claim and run batches, and the
engine flags they (and ``conductor run``) share."""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

from conductor.cli.args import non_negative_float, positive_float, positive_int
from conductor.cli.connect import conductor_from
from conductor.errors import ConductorError

ENGINES = ("sim", "torch", "trtllm", "vllm", "openai")
# The contract flags' defaults where the engine does not say (vllm takes them from its configuration,
# openai's input length from the server's max_model_len when it tells).
CONTRACT_DEFAULTS = {"max_batch_size": 64, "max_batch_tokens": 8192, "max_input_len": 4096}


def engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--engine", choices=ENGINES, default="sim",
                   help="sim: a cost model, no GPU; torch: transformers; trtllm: TensorRT-LLM; vllm: vLLM in "
                        "process; openai: any OpenAI-compatible server (--endpoint)")
    if model_required:
        p.add_argument("--model", required=True, help="model name (the engine's identity in the conductor)")
    p.add_argument("--model-path", help="torch/trtllm/vllm: local model folder (torch: 'tiny' for a random tiny "
                                        "Llama; python -m conductor.workers.engines.random_model DIR writes one)")
    p.add_argument("--max-batch-size", type=positive_int,
                   help="items per batch (the contract; default 64, vllm: its max_num_seqs, which this sets)")
    p.add_argument("--max-batch-tokens", type=positive_int,
                   help="input tokens per batch, padded in memory mode (the contract; default 8192, vllm: its KV "
                        "cache in tokens)")
    p.add_argument("--max-input-len", type=positive_int,
                   help="longest input the engine takes; longer items get an error result (default 4096, vllm: "
                        "its max_model_len - 1, openai: the server's when it says)")
    p.add_argument("--sim-time-scale", type=non_negative_float, default=0.0,
                   help="sim: multiply the cost model's sleeps by this (0: no sleeping)")
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE", type=engine_arg,
                   help="vllm: one of vLLM's EngineArgs (gpu_memory_utilization=0.85, max_model_len=8192, "
                        "tensor_parallel_size=2); the value is read as JSON when it parses, else as text; repeat it")
    p.add_argument("--endpoint", metavar="URL", help="openai: the server's base URL (http://host:8000/v1)")
    p.add_argument("--api-key", dest="engine_api_key", metavar="KEY",
                   help="openai: the server's API key (default: env OPENAI_API_KEY, else none)")
    p.add_argument("--served-model", metavar="NAME", help="openai: the model name the server knows "
                                                         "(default: --model)")
    p.add_argument("--max-in-flight", type=positive_int,
                   help="openai: requests in flight to the server at most; the worker adapts below it (halved on "
                        "429, 5xx and timeouts, grown on success; default: the batch size)")


def engine_arg(raw: str) -> tuple[str, Any]:
    key, sep, value = raw.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{raw!r} is not KEY=VALUE with KEY one of vLLM's EngineArgs fields")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


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


def contract_value(args: argparse.Namespace, name: str) -> Any:
    """A flag's value as the engine gets it: a contract flag left out is its default for the engines
    with one (sim, torch, trtllm), None for those that take it from themselves (vllm, openai)."""
    v = getattr(args, name)
    if v is None and name in CONTRACT_DEFAULTS and args.engine not in ("vllm", "openai"):
        return CONTRACT_DEFAULTS[name]
    return v


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """make_engine's keyword arguments from the engine flags (plain data: the agent sends them on)."""
    kw: dict[str, Any] = {"model": args.model}
    given = {k: getattr(args, k) for k in CONTRACT_DEFAULTS}
    if args.engine == "vllm":
        kw.update(given, model_path=args.model_path, engine_args=dict(args.engine_arg or ()))
        return kw
    if args.engine_arg:
        raise ConductorError(f"--engine-arg: only the vllm engine takes engine arguments, not {args.engine}")
    if args.engine == "openai":
        if not args.endpoint:
            raise ConductorError("--endpoint: required with --engine openai (the server's base URL, "
                                 "http://host:8000/v1)")
        kw.update(given, endpoint=args.endpoint, api_key=args.engine_api_key or os.environ.get("OPENAI_API_KEY"),
                  served_model=args.served_model, max_in_flight=args.max_in_flight)
        return kw
    kw.update({k: contract_value(args, k) for k in CONTRACT_DEFAULTS})
    if args.engine == "sim":
        kw.update(time_scale=args.sim_time_scale)
    else:
        kw.update(model_path=args.model_path)
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
    if args.engine not in ("sim", "openai") and not args.model_path:
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
