"""Driver: what a fit reports of its training job: the seconds of its steps
(``FitClock``), the ranks' data placement (logged), devices, memory and decoding, for the
fitted model's training summary."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..shared.summary import RankSummary

logger = logging.getLogger(__name__)


def log_placements(summaries: list[RankSummary]) -> None:
    """One INFO line per way the ranks placed their data (held on the device, or streamed
    and why), naming the ranks."""
    ranks: dict[str, list[int]] = {}
    for s in summaries:
        ranks.setdefault(s.data_placement, []).append(s.rank)
    for placement, which in ranks.items():
        listed = ", ".join(map(str, which))
        logger.info("rank%s %s: data %s", "s" if len(which) > 1 else "", listed, placement)


def rank_devices(summaries: list[RankSummary]) -> list[dict]:
    """Per rank: its host, the device it trained on and the GPU addresses Spark assigned
    its task (also where it fell back to the CPU), for the training summary."""
    return [
        {"rank": s.rank, "host": s.host, "device": s.device, "gpu_addresses": s.gpu_addresses}
        for s in sorted(summaries, key=lambda s: s.rank)
    ]


def rank_memory(summaries: list[RankSummary]) -> list[dict]:
    """Per rank: the parameter elements it held (a shard of the model's with FSDP) and its
    peak memory, for the training summary."""
    return [
        {
            "rank": s.rank,
            "parameter_elements": s.parameter_elements,
            "peak_memory_mib": round(s.peak_memory_bytes / 2**20, 1),
            "memory": s.peak_memory_kind,
        }
        for s in sorted(summaries, key=lambda s: s.rank)
    ]


def decoding_summary(summaries: list[RankSummary]) -> dict:
    """What decoding the variable columns did, over all ranks: the rows left out
    (bad_rows='skip'), the share of padded sequences' values that were padding, and what
    decoded them on each rank (threads or processes, how many, the worker processes' peak
    memory)."""
    real = sum(s.padding[0] for s in summaries)
    total = sum(s.padding[1] for s in summaries)
    out = {"rows_skipped": sum(s.rows_skipped for s in summaries)}
    if total:
        out["padding"] = {"values": real, "padded": total, "share": round(1 - real / total, 4)}
    decoding = [(s.rank, s.decoding) for s in sorted(summaries, key=lambda s: s.rank)]
    if any(d for _, d in decoding):
        out["decoding"] = [_rank_decoding(rank, d) for rank, d in decoding if d]
    return out


def _rank_decoding(rank: int, found: dict) -> dict:
    """One rank's decoding as the summary shows it: memory in MiB."""
    out = {"rank": rank, "pool": found["pool"], "workers": found["workers"]}
    for memory in ("uss", "pss", "rss"):
        if f"worker_{memory}_bytes" in found:
            out[f"worker_{memory}_mib"] = [
                round(b / 2**20, 1) for b in found[f"worker_{memory}_bytes"]
            ]
    if "worker_start_seconds" in found:
        out["worker_start_seconds"] = found["worker_start_seconds"]
    if found.get("note"):
        out["note"] = found["note"]
    return out


def warn_decoding_notes(summaries: list[RankSummary]) -> None:
    """What the ranks noted of their decoding (worker processes that could not decode as
    asked), warned of once per note, naming the ranks."""
    notes: dict[str, list[int]] = {}
    for s in sorted(summaries, key=lambda s: s.rank):
        if s.decoding and s.decoding.get("note"):
            notes.setdefault(s.decoding["note"], []).append(s.rank)
    for note, ranks in notes.items():
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        logger.warning("%s (%s)", note, which)


class FitClock:
    """The seconds of a fit's steps, as its training summary reports them."""

    def __init__(self):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = time.perf_counter() - start

    def report(self, summaries: list[RankSummary]) -> dict[str, float]:
        """Seconds of: validation; dataset (materialized, found in the store, or described
        from the given Parquet); launch (the training job less the ranks' training: Spark
        scheduling, process group, the ranks' set-up and teardown); training (the longest
        rank's loop); result (the rest: the run's manifest before the job, reading the
        result and building the model after it); total. Rounded to ms."""
        job = self.seconds.pop("job")
        training = max((s.seconds for s in summaries), default=0.0)
        out = {**self.seconds, "launch": max(0.0, job - training), "training": training}
        total = time.perf_counter() - self.started
        out["result"] = total - sum(out.values())
        out["total"] = total
        return {k: round(v, 3) for k, v in out.items()}
