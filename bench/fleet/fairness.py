"""Issue 26: one fleet, many jobs. Token-weighted fair share between tenants, interactive work
first, earliest deadline first, and what fairness costs against first-come-first-served.

    .venv/bin/python bench/fleet/fairness.py                       # every scenario; rewrites its RESULTS.md section
    .venv/bin/python bench/fleet/fairness.py --quick --no-write    # small forms, seconds (the test suite runs it)

Every scenario runs the real ``Worker`` loop on the real Lua scripts with sim engines in simulated
time (bench/packing/suite.py's drive; a submission due at a simulated time is made when the fleet's clock
reaches it). Service is what bench/ and lua/complete.lua count alike: a batch's padded input tokens
plus ``decode_weight`` (64) times its output tokens. A batch time is the median time a batch takes
from its admission to its last item's result.

* ``shares-1:1``: tenants A and B, weight 1 each, both backlogged from the start, A with 9x B's
  items: each tenant's share of the service in every window of 10 consecutive batches while both
  wait, and the largest service gap (|S_A/w_A - S_B/w_B|) in batches' worth of service.
* ``shares-3:1``: the same with A weighted 3.
* ``late``: B arrives when a third of A's backlog is done: from its submission to its first batch,
  in batch times.
* ``interactive``: 50 interactive requests (one item each) arriving over the run into a backlog on
  2 workers: time to result in batch times, p50 and p99.
* ``deadlines``: three jobs of one tenant submitted at once, run without deadlines and with deadlines
  in the order small, mid, big; the small job's due time halfway between its two finishes.
* ``cost``: the shares-1:1 items as two tenants against the same items as one job (first come,
  first served): finished sequences/s under the sim and the static model, shape switches per worker.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import static_cost  # noqa: E402
from bench.common.report import command_line, git_rev, machine, now_utc, table, write_section  # noqa: E402
from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing import suite, sweep  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.jobs.tenants import set_weight  # noqa: E402
from conductor.redis_contract.records import JobClass, PreparedItem  # noqa: E402
from conductor.workers.engines.sim import output_len  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

MODEL = "bench-sim"
DECODE_WEIGHT = 64
EPOCH_MS = 1_800_000_000_000  # deadlines are compared, never waited for: any fixed origin does
# Sequences each sim engine runs at once (its max_num_seqs; --engine-seqs). 1024: the engine of the
# earlier runs (its latch's high water); 64, its batch: a real engine's shape (vLLM's batch is its
# max_num_seqs), where the worker holds about one batch beyond what runs.
ENGINE_SEQS = 1024


@dataclass
class JobSpec:
    job: str
    spec: WorkloadSpec
    tenant: str = ""
    priority: str = "batch"
    at: float = 0.0  # simulated seconds at which it is submitted
    deadline_s: float = 0.0  # simulated seconds, 0: none
    spread_s: float = 0.0  # its items arrive one by one over this long after `at` (requests)


class Recorder(suite.RecordingSim):
    """The sim engine, also noting when each batch was admitted and each item finished."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.admitted: list[tuple[float, int, int, list[str]]] = []  # (t, items, padded len, ids)
        self.done_at: dict[str, float] = {}

    def admit(self, batch: Any, items: list[Any]) -> list[Any]:
        self.admitted.append((self.counters.sim_seconds, len(items), batch.padded_len, [it.id for it in items]))
        return super().admit(batch, items)

    def step(self) -> list[Any]:
        done = super().step()
        for fin in done:
            self.done_at[fin.item.id] = self.counters.sim_seconds
        return done


class Submissions:
    """Submits each job's items when the fleet's simulated clock reaches them (the drive's release)."""

    def __init__(self, c: Conductor, jobs: list[JobSpec], items: dict[str, list[PreparedItem]]) -> None:
        self.c = c
        self.queue: list[tuple[float, JobSpec, list[PreparedItem]]] = []
        for j in jobs:
            its = items[j.job]
            if j.spread_s > 0:
                step = j.spread_s / max(1, len(its))
                self.queue += [(j.at + k * step, j, [it]) for k, it in enumerate(its)]
            else:
                self.queue.append((j.at, j, its))
        self.queue.sort(key=lambda q: q[0])
        self.submitted_at: dict[str, float] = {}
        self.classed: set[str] = set()
        self.spent = 0.0

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def __call__(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            at, j, its = self.queue.pop(0)
            t = time.perf_counter()
            if j.job not in self.classed:
                deadline = int(EPOCH_MS + j.deadline_s * 1000) if j.deadline_s else 0
                self.c.set_job_class(j.job, [MODEL], JobClass(j.tenant, j.priority, deadline))
                self.classed.add(j.job)
            self.c.submit(its, j.job, seal=True)
            self.spent += time.perf_counter() - t
            for it in its:
                self.submitted_at[it.id] = at


@dataclass
class Run:
    engines: list[Recorder]
    tenant_of: dict[str, str]  # item id -> tenant
    job_of: dict[str, str]
    submitted_at: dict[str, float]
    items: list[PreparedItem]
    makespan: float = 0.0
    switches: float = 0.0
    notes: list[str] = field(default_factory=list)

    def service(self, ids: list[str], plen: int) -> float:
        it = self._by_id()
        return len(ids) * plen + DECODE_WEIGHT * sum(output_len(i, it[i].max_tokens) for i in ids)

    def _by_id(self) -> dict[str, PreparedItem]:
        if not hasattr(self, "_idx"):
            self._idx = {it.id: it for it in self.items}
        return self._idx

    def batches(self) -> list[tuple[float, str, float]]:
        """(t, tenant, service) of every batch, in admission order across the fleet."""
        out = [(t, self.tenant_of[ids[0]], self.service(ids, plen))
               for e in self.engines for t, _n, plen, ids in e.admitted if ids]
        return sorted(out, key=lambda b: b[0])

    def batch_time(self) -> float:
        """The median time a batch takes, from its admission to its last item's result."""
        done = self.done_at()
        spans = [max(done[i] for i in ids) - t for e in self.engines for t, _n, _p, ids in e.admitted
                 if ids and all(i in done for i in ids)]
        return statistics.median(spans) if spans else float("nan")

    def done_at(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.engines:
            out.update(e.done_at)
        return out


def run(r: Any, url: str, jobs: list[JobSpec], workers: int, weights: dict[str, float] | None = None,
        max_wall_s: float = 900.0) -> Run:
    r.flushall()
    r.script_flush()
    c = Conductor(connect(url))
    c.ensure_model(MODEL)
    c.set_config(MODEL, {"decode_weight": DECODE_WEIGHT})
    for t, w in (weights or {}).items():
        set_weight(c, t, w)
    items = {j.job: generate(j.spec).items for j in jobs}
    engines = [Recorder(MODEL, max_batch_size=64, max_batch_tokens=65_536, max_input_len=8192, time_scale=0.0,
                        max_num_seqs=ENGINE_SEQS) for _ in range(workers)]
    ws = []
    for i, eng in enumerate(engines):
        w = Worker(Conductor(connect(url)), eng, WorkerOptions(name=f"fair-w{i}", high_water=1024, low_water=768,
                                                                heartbeat_ttl_s=3600.0))
        w.register()
        ws.append(w)
    subs = Submissions(c, jobs, items)
    subs(0.0)
    total = sum(len(v) for v in items.values())
    makespan, _wall = suite.drive(ws, engines, total, lambda: sum(w.finished for w in ws),
                                  subs if subs.pending else None, max_wall_s, idle_max=sweep.POLL_MAX_S)
    for w in ws:
        while w.retry or w.inflight:
            w.turn()
        w.deregister()
    tenant_of, job_of = {}, {}
    for j in jobs:
        for it in items[j.job]:
            tenant_of[it.id] = j.tenant or j.job
            job_of[it.id] = j.job
    all_items = [it for v in items.values() for it in v]
    out = Run(engines, tenant_of, job_of, subs.submitted_at, all_items, makespan)
    out.switches = statistics.mean(e.counters.shape_switches for e in engines)
    return out


# ------------------------------------------------------------------------------------ scenarios
def _spec(seed: int, items: int, shapes: int, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, items=items, shapes=shapes, model=MODEL, **kw)


def shares(res: Run, weights: dict[str, float], window: int = 10) -> dict[str, Any]:
    """Shares over windows of ``window`` batches while every tenant still had batches to come."""
    bs = res.batches()
    tenants = sorted(weights)
    last = {t: max((i for i, b in enumerate(bs) if b[1] == t), default=-1) for t in tenants}
    end = min(last.values())  # until the first tenant's last batch: both backlogged before it
    both = bs[:end + 1]
    target = weights[tenants[0]] / sum(weights.values())
    devs = []
    for i in range(0, max(0, len(both) - window + 1)):
        win = both[i:i + window]
        tot = sum(b[2] for b in win)
        devs.append(sum(b[2] for b in win if b[1] == tenants[0]) / tot - target)
    cum = {t: 0.0 for t in tenants}
    gap = 0.0
    for _t, ten, s in both:
        cum[ten] += s / weights[ten]
        gap = max(gap, abs(cum[tenants[0]] - cum[tenants[1]]))
    mean_batch = statistics.mean(b[2] for b in both) if both else float("nan")
    overall = sum(b[2] for b in both if b[1] == tenants[0]) / max(1e-9, sum(b[2] for b in both))
    return {"target": target, "share": overall, "windows": len(devs),
            "dev_p50": statistics.median(abs(d) for d in devs) if devs else float("nan"),
            "dev_max": max((abs(d) for d in devs), default=float("nan")),
            "gap_batches": gap * (sum(weights.values()) / len(weights)) / mean_batch if both else float("nan"),
            "batches_both": len(both)}


def scenario_shares(r: Any, url: str, quick: bool, wa: float) -> dict[str, Any]:
    n = 2000 if quick else 20_000
    jobs = [JobSpec("a-big", _spec(11, n * 9 // 10, 12), tenant="A"),
            JobSpec("b-small", _spec(12, n // 10, 4), tenant="B")]
    weights = {"A": wa, "B": 1.0}
    res = run(r, url, jobs, 2, weights)
    out = shares(res, weights)
    out["batch_time"] = res.batch_time()
    return out


def scenario_late(r: Any, url: str, quick: bool) -> dict[str, Any]:
    n = 2000 if quick else 12_000
    first = run(r, url, [JobSpec("a", _spec(21, n, 10), tenant="A")], 2)
    at = first.makespan / 3
    res = run(r, url, [JobSpec("a", _spec(21, n, 10), tenant="A"),
                       JobSpec("b", _spec(22, n // 10, 3), tenant="B", at=at)], 2)
    firsts = [t for e in res.engines for t, _n, _p, ids in e.admitted if ids and res.tenant_of[ids[0]] == "B"]
    wait = (min(firsts) - at) if firsts else float("nan")
    return {"arrives_s": at, "first_batch_after_s": wait, "batch_time": res.batch_time(),
            "wait_batches": wait / res.batch_time()}


def scenario_interactive(r: Any, url: str, quick: bool) -> dict[str, Any]:
    n = 3000 if quick else 100_000
    reqs = 20 if quick else 50
    first = run(r, url, [JobSpec("backlog", _spec(31, n, 30))], 2)
    span = first.makespan / 2
    res = run(r, url, [JobSpec("backlog", _spec(31, n, 30)),
                       JobSpec("rq.bench", _spec(32, reqs, 2, output_limits=(32,)), priority="interactive",
                               at=span / 10, spread_s=span * 0.8)], 2)
    done = res.done_at()
    lat = sorted(done[i] - res.submitted_at[i] for i, j in res.job_of.items() if j == "rq.bench")
    bt = res.batch_time()
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"requests": len(lat), "batch_time": bt, "p50_batches": p(0.5) / bt, "p99_batches": p(0.99) / bt,
            "p50_s": p(0.5), "p99_s": p(0.99)}


def scenario_deadlines(r: Any, url: str, quick: bool) -> dict[str, Any]:
    """Three jobs of one tenant at once: run without deadlines (the fleet's own order: longest
    decodes, most work first) and with deadlines in the order small, mid, big. The small job's due
    time is set halfway between its two finishes: feasible only when it goes first."""
    k = 1 if quick else 4
    specs = [("big", _spec(41, 3000 * k, 4)), ("mid", _spec(42, 1000 * k, 3)), ("small", _spec(43, 400 * k, 2))]
    order = {"small": 1.0, "mid": 2.0, "big": 3.0}

    def finishes(deadlines: bool) -> dict[str, float]:
        res = run(r, url, [JobSpec(n, sp, tenant="T", deadline_s=order[n] if deadlines else 0.0) for n, sp in specs], 1)
        done = res.done_at()
        return {n: max(t for i, t in done.items() if res.job_of[i] == n) for n, _ in specs}
    plain, edf = finishes(False), finishes(True)
    due = (plain["small"] + edf["small"]) / 2
    return {"small_due_s": due, "edf": edf, "without": plain, "met_edf": edf["small"] <= due,
            "met_without": plain["small"] <= due}


def scenario_cost(r: Any, url: str, quick: bool) -> dict[str, Any]:
    n = 2000 if quick else 20_000
    a, b = _spec(11, n * 9 // 10, 12), _spec(12, n // 10, 4)
    fair = run(r, url, [JobSpec("a-big", a, tenant="A"), JobSpec("b-small", b, tenant="B")], 2)
    fcfs = run(r, url, [JobSpec("a-big", a, tenant="AB"), JobSpec("b-small", b, tenant="AB")], 2)
    out: dict[str, Any] = {}
    for name, res in (("fair", fair), ("fcfs", fcfs)):
        wl_items = res.items
        prefixes = {s.sig: s.prefix_tokens for sp in (a, b) for s in generate(sp).shapes}
        st = static_cost.replay([static_cost.batches_from_log(e.log) for e in res.engines],
                                static_cost.Items(wl_items, [0.0] * len(wl_items), prefixes), sweep.STATIC)
        out[name] = {"seq_s": len(wl_items) / res.makespan, "static_seq_s": st.seq_s, "switches": res.switches}
    out["ratio_sim"] = out["fair"]["seq_s"] / out["fcfs"]["seq_s"]
    out["ratio_static"] = out["fair"]["static_seq_s"] / out["fcfs"]["static_seq_s"]
    return out


SCENARIOS: dict[str, Callable[[Any, str, bool], dict[str, Any]]] = {
    "shares-1:1": lambda r, u, q: scenario_shares(r, u, q, 1.0),
    "shares-3:1": lambda r, u, q: scenario_shares(r, u, q, 3.0),
    "late": scenario_late,
    "interactive": scenario_interactive,
    "deadlines": scenario_deadlines,
    "cost": scenario_cost,
}


def report(res: dict[str, dict[str, Any]], quick: bool, mach: str, wall: float) -> str:
    rows = []
    for name in ("shares-1:1", "shares-3:1"):
        if name in res:
            s = res[name]
            ok = s["dev_p50"] <= 0.05 and s["gap_batches"] <= 2
            rows.append([name, f"share of A {s['share']:.1%} (goal {s['target']:.0%}); per 10-batch window: "
                               f"deviation p50 {s['dev_p50']:.1%}, max {s['dev_max']:.1%} over {s['windows']} windows; "
                               f"largest service gap {s['gap_batches']:.2f} batches",
                         "met" if ok else "**missed**"])
    if "late" in res:
        s = res["late"]
        rows.append(["late", f"B's first batch {s['wait_batches']:.2f} batch times after it arrived "
                             f"({s['first_batch_after_s']:.3f} s; a batch time is {s['batch_time']:.3f} s)",
                     "met" if s["wait_batches"] <= 1 else "**missed**"])
    if "interactive" in res:
        s = res["interactive"]
        rows.append(["interactive", f"{s['requests']} requests: time to result p50 {s['p50_batches']:.2f}, p99 "
                                    f"{s['p99_batches']:.2f} batch times ({s['p50_s']:.3f} s, {s['p99_s']:.3f} s)",
                     "met" if s["p99_batches"] <= 2 else "**missed**"])
    if "deadlines" in res:
        d = res["deadlines"]
        fin = lambda f: ", ".join(f"{n} {t:.2f} s" for n, t in f.items())  # noqa: E731
        how = "only with" if d["met_edf"] and not d["met_without"] else "with" if d["met_edf"] else "not even with"
        rows.append(["deadlines", f"finished with deadlines (earliest first): {fin(d['edf'])}; without: "
                                  f"{fin(d['without'])}; the small job due at {d['small_due_s']:.2f} s meets it "
                                  f"{how} deadlines", "met" if d["met_edf"] else "**missed**"])
    if "cost" in res:
        s = res["cost"]
        sw = f"{s['fair']['switches']:.1f} (first-come {s['fcfs']['switches']:.1f})"
        rows.append(["cost", f"fair/first-come sim {s['ratio_sim']:.3f}x, static {s['ratio_static']:.3f}x; shape "
                             f"switches per worker {sw}",
                     "met" if min(s["ratio_sim"], s["ratio_static"]) >= 0.97 else "**missed**"])
    return "\n".join([
        f"## Fairness: tenants, interactive work, deadlines (issue 26{', quick' if quick else ''})",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {git_rev()}; {wall:,.0f} s wall.  ",
        "Each scenario: the real Worker loop on the real Lua scripts, sim engines in simulated time "
        f"(bench/fleet/fairness.py's docstring says what each does; 2 workers but deadlines, on 1; each engine runs "
        f"{ENGINE_SEQS} sequences at once, batches of 64). Service = padded "
        f"input tokens + {DECODE_WEIGHT} x output tokens. Goals (issue 26): shares within 5 points of the "
        "weights over windows of 10 batches and a service gap of at most 2 batches; a late tenant served within "
        "1 batch time; interactive p99 at most 2 batch times; the job due first meets its deadline; fairness "
        "at least 0.97x first-come-first-served under both cost models.",
        "",
        table(["scenario", "figures", "goal"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    global ENGINE_SEQS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small forms (seconds)")
    p.add_argument("--scenarios", default="", help="comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md untouched")
    p.add_argument("--engine-seqs", type=int, default=ENGINE_SEQS,
                   help="sequences each sim engine runs at once (its max_num_seqs; 64 is one batch)")
    args = p.parse_args(argv)
    ENGINE_SEQS = args.engine_seqs
    names = [n for n in args.scenarios.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {unknown}")
    t0 = time.monotonic()
    res: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        mach = machine(r)
        for name in names:
            res[name] = SCENARIOS[name](r, srv.url, args.quick)
            print(f"  {name}: {res[name]}", flush=True)
    text = report(res, args.quick, mach, time.monotonic() - t0)
    print()
    print(text)
    if not args.no_write:
        suffix = "" if ENGINE_SEQS == 1024 else f"_seqs{ENGINE_SEQS}"
        write_section(("fairness_quick" if args.quick else "fairness") + suffix, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
