"""Where submit.lua spends its server time: copies with one part taken out (the file is never
changed), each submitting the same items to a flushed server, in turn, several times.

    .venv/bin/python bench/submit_profile.py [--items 30000] [--reps 3] [--chunk 1000]

Copies: ``as is``; ``no lane counters`` (the per-lane hash, fill, ready and touch updates at
the end of a call are skipped); ``no dedupe`` (the per-item HSETNX on the job's id set is
skipped); ``no XADD`` (the lane append is skipped). The difference to ``as is`` is what that
part costs per item. A copy whose anchor line is gone from submit.lua is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from bench.common import median  # noqa: E402
from conductor.client import Conductor, _submit_args, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.scripts import source  # noqa: E402

CUTS = {
    "no lane counters": ("  for _, lane in ipairs(ctx.order) do\n", "  for _, lane in ipairs({}) do\n"),
    "no dedupe": ("  if redis.call('HSETNX', base .. ':job:' .. job .. ':items', id, 'q') == 0 then",
                  "  if false then"),
    "no XADD": ("    redis.call('XADD', base .. ':lane:' .. ctx.inst .. ':' .. lane, '*',\n"
                "      'id', id, 'job', job, 'tok', tok, 'mt', mt, 'd', body)\n", ""),
}


def copies() -> tuple[dict[str, str], list[str]]:
    src = source("submit")
    out, skipped = {"as is": src}, []
    for name, (anchor, new) in CUTS.items():
        if src.count(anchor) == 1:
            out[name] = src.replace(anchor, new)
        else:
            skipped.append(name)
    return out, skipped


def profile(r: redis.Redis, n: int, reps: int, chunk: int, shapes: int = 20, log=print) -> dict[str, object]:
    from bench.submit_claim import MODEL, make_items
    items = make_items(n, shapes=shapes, seed=1, tag="s")
    srcs, skipped = copies()
    scripts = {k: r.register_script(v) for k, v in srcs.items()}
    per_item: dict[str, list[float]] = {k: [] for k in scripts}
    for _ in range(reps):
        for name, sc in scripts.items():
            r.flushall()
            c = Conductor(r)
            mk = c.ensure_model(MODEL)
            r.config_resetstat()
            for s in range(0, n, chunk):
                sc(keys=[mk.base, mk.cfg, mk.state], args=_submit_args("j", items[s:s + chunk]))
            per_item[name].append(float(r.info("commandstats")["cmdstat_evalsha"]["usec"]) / n)
    res = {k: median(v) for k, v in per_item.items()}
    for k, v in res.items():
        log(f"  submit copy {k:18s} {v:6.1f} us server per item")
    return {"per_item": res, "skipped": skipped, "chunk": chunk, "shapes": shapes}


def as_markdown(res: dict[str, object]) -> str:
    per = res["per_item"]
    base = per["as is"]  # type: ignore[index]
    lines = ["| submit.lua copy | server us per item | the part costs |", "|---|---|---|"]
    for k, v in per.items():  # type: ignore[union-attr]
        lines.append(f"| {k} | {v:.1f} | {'' if k == 'as is' else f'{base - v:.1f} us/item'} |")
    if res["skipped"]:
        lines += ["", f"Skipped (anchor gone from submit.lua): {', '.join(res['skipped'])}."]  # type: ignore[arg-type]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=30_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1000)
    a = p.parse_args(argv)
    with EmbeddedRedis() as srv:
        print(as_markdown(profile(connect(srv.url), a.items, a.reps, a.chunk)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
