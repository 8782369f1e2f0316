"""The figures ``conductor run`` ends with: batches, mean items per batch and padding from the
result records themselves (each names its batch, batch size and padded length), and prefix-cache
hits from the workers' own Prometheus endpoints (the engine counts them; nothing else knows)."""

from __future__ import annotations

import time
import urllib.request

import msgspec
from prometheus_client.parser import text_string_to_metric_families


class _Row(msgspec.Struct):
    batch: str = ""
    shape: str = ""
    batch_size: int = 0
    batch_padded_len: int = 0
    input_tokens: int = 0


_decode = msgspec.json.Decoder(_Row).decode


class RunSummary:
    def __init__(self) -> None:
        self.results = 0
        self.actual_tokens = 0
        # (shape, batch id) -> its padded tokens: a batch id is unique only on its shard, a shape lives on one
        self._batches: dict[tuple[str, str], int] = {}
        self.prefix_hit_tokens: int | None = None
        self.unread = ""  # why the workers' figures are unknown: the port and the error
        self.engine_queries = self.engine_hits = 0  # the engine's own prefix-cache count (vllm), in its tokens
        self.busy_s: list[float] = []  # each worker's busy seconds (its engine held sequences), when all were read

    def add(self, record: bytes) -> None:
        row = _decode(record)
        self.results += 1
        if not row.batch:  # an item answered without running (dead-lettered): no batch to count
            return
        self.actual_tokens += row.input_tokens
        self._batches.setdefault((row.shape, row.batch), row.batch_padded_len * row.batch_size)

    @property
    def batches(self) -> int:
        return len(self._batches)

    def padding(self) -> float:
        padded = sum(self._batches.values())
        return 1 - self.actual_tokens / padded if padded else 0.0

    def scrape_workers(self, ports: list[int], timeout_s: float = 5.0) -> None:
        """Sum conductor_prefix_hit_tokens and take each worker's conductor_worker_busy_seconds from the
        workers' endpoints; both left unknown if any is unreadable (a partial sum would understate the
        hits, a missing worker would hide the imbalance)."""
        total, busy, queries, hits = 0.0, [], 0.0, 0.0
        for port in ports:
            text = ""
            for attempt in range(3):  # a busy worker's metrics thread may miss one read
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
                        text = resp.read().decode()
                    break
                except OSError as e:
                    self.unread = f"port {port}: {e}"
                    time.sleep(0.2 * (attempt + 1))
            else:
                return
            for fam in text_string_to_metric_families(text):
                if fam.name == "conductor_prefix_hit_tokens":
                    total += sum(s.value for s in fam.samples if s.name.endswith("_total"))
                elif fam.name == "conductor_worker_busy_seconds":
                    busy.append(sum(s.value for s in fam.samples if s.name.endswith("_total")))
                elif fam.name == "conductor_engine_prefix_cache_queries":
                    queries += sum(s.value for s in fam.samples if s.name.endswith("_total"))
                elif fam.name == "conductor_engine_prefix_cache_hits":
                    hits += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        self.unread = ""
        self.prefix_hit_tokens = int(total)
        self.busy_s = busy
        self.engine_queries, self.engine_hits = int(queries), int(hits)

    def text(self) -> str:
        mean = self.results / self.batches if self.batches else 0.0
        hits = f"prefix hits unknown ({self.unread or 'not read'})" if self.prefix_hit_tokens is None else (
            f"prefix hits {self.prefix_hit_tokens:,} tokens "
            f"({self.prefix_hit_tokens / self.actual_tokens if self.actual_tokens else 0:.1%} of input tokens)")
        fleet = ""
        if len(self.busy_s) > 1 and sum(self.busy_s) > 0:
            fleet = (f", {len(self.busy_s)} workers busy {min(self.busy_s):.1f} to {max(self.busy_s):.1f} s "
                     f"(max/mean {max(self.busy_s) / (sum(self.busy_s) / len(self.busy_s)):.2f})")
        engine = (f", the engine's prefix cache {self.engine_hits / self.engine_queries:.1%} of "
                  f"{self.engine_queries:,} prompt tokens" if self.engine_queries else "")
        return (f"{self.batches:,} batches, {mean:.1f} items per batch (mean), padding {self.padding():.1%} "
                f"of dispatched tokens, {hits}{engine}{fleet}")
