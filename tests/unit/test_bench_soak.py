"""The soak bench's pure parts (``bench/soak.py``): its options, one interval's row, the
verdicts and the reading of the worker's pruning log. No database, no timing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import soak

STATS = {
    "heap_bytes": 10 * 2**20,
    "index_bytes": 4 * 2**20,
    "toast_bytes": 2**20,
    "all_bytes": 20 * 2**20,
    "dead": 123,
    "vacuums": 2,
    "autovacuums": 1,
    "kept_fired": 5_000,
    "overdue": 7,
}


def test_quick_and_full_plans() -> None:
    quick, out = soak.parse_args(["--quick"])
    assert quick == soak.QUICK
    assert (quick.minutes, quick.pending, quick.rate, quick.retention_s) == (5, 200_000, 1_000, 60)
    assert quick.interval_s == 10
    assert out == Path("/tmp/soak")
    full, _ = soak.parse_args([])
    assert (full.minutes, full.pending, full.rate, full.interval_s) == (60, 5_000_000, 5_000, 60)


def test_each_size_can_be_overridden() -> None:
    plan, out = soak.parse_args(
        ["--quick", "--rate", "250", "--pending", "0", "--vacuum-every-s", "0", "--out", "/x"]
    )
    assert (plan.rate, plan.pending, plan.vacuum_every_s) == (250, 0, 0.0)
    assert plan.minutes == soak.QUICK.minutes  # the rest stays the quick plan's
    assert out == Path("/x")


@pytest.mark.parametrize(
    "argv", [["--rate", "0"], ["--minutes", "-1"], ["--retention-s", "0"], ["--pending", "-5"]]
)
def test_nonsense_sizes_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        soak.parse_args(argv)
    assert "must be positive" in capsys.readouterr().err


def test_an_interval_row_from_samples_and_figures() -> None:
    samples = [x / 10 for x in range(1, 1001)]  # 0.1..100 ms
    row = soak.aggregate(
        3, 30.0, 40.0, samples, produced=99, pruned=1_000, stats=STATS, rss_mb=80.0, load="1.5"
    )
    assert (row.index, row.fires, row.fires_per_s) == (3, 1_000, 100.0)
    assert (row.p50_ms, row.p99_ms, row.max_ms) == (50.0, 99.0, 100.0)
    assert (row.produced, row.pruned, row.overdue, row.kept_fired) == (99, 1_000, 7, 5_000)
    assert (row.heap_mb, row.index_mb, row.timer_total_mb, row.all_tables_mb) == (10, 4, 15, 20)
    assert (row.dead_tuples, row.vacuums, row.autovacuums) == (123, 2, 1)
    line = soak.render(row)
    assert line.count("|") == len(soak.COLUMNS) + 1
    assert "| 40 | 100 | 50.0 | 99.0 | 100.0 | 7 | 5,000 | 1,000 |" in line


def test_an_interval_without_fires_has_no_lateness() -> None:
    row = soak.aggregate(0, 0, 10, [], produced=0, pruned=0, stats=STATS, rss_mb=1, load="0")
    assert row.fires == 0 and math.isnan(row.p99_ms)


def _row(end_s: float, p99: float, total_mb: float) -> soak.Interval:
    stats = {**STATS, "heap_bytes": total_mb * 2**20, "index_bytes": 0, "toast_bytes": 0}
    return soak.aggregate(
        0, end_s - 10, end_s, [1.0, p99], produced=2, pruned=0, stats=stats, rss_mb=1, load="0"
    )


def test_verdicts_measure_growth_from_retention_plus_one_pruning_pass() -> None:
    plan, _ = soak.parse_args(["--quick"])  # retention 60 s: steady from 120 s
    rows = [_row(t, 10.0, 100.0 + t) for t in range(10, 310, 10)]
    v = soak.verdicts(rows, plan)
    assert (v["size_from_mb"], v["size_to_mb"]) == (220.0, 400.0)  # 120 s and 300 s
    assert v["size_growth_pct"] == pytest.approx(81.8, abs=0.1)
    assert v["p99_hit"] and v["worst_interval_p99_ms"] == 10.0
    rows.append(_row(310, 30.0, 400.0))
    assert not soak.verdicts(rows, plan)["p99_hit"]


def test_a_run_shorter_than_retention_gives_no_growth_figure() -> None:
    plan, _ = soak.parse_args(["--quick"])
    assert soak.verdicts([_row(10, 1, 10), _row(20, 1, 10)], plan)["size_growth_pct"] is None


def test_prune_log_sums_complete_lines_once(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("x timers.pruned rows=10000 node=w1\nshard.loaded shard=1\n")
    reader = soak.PruneLog(log)
    assert reader.read() == 10_000
    assert reader.read() == 0
    with log.open("a") as f:
        f.write("y timers.pruned rows=5 node=w1\nz timers.pruned rows=7")  # last line unfinished
    assert reader.read() == 5
    with log.open("a") as f:
        f.write(" node=w1\n")
    assert reader.read() == 7


def test_cluster_option_and_the_last_autovacuum_column() -> None:
    plan, _ = soak.parse_args(["--quick", "--cluster"])
    assert plan.cluster and not soak.QUICK.cluster
    assert "autovacuum=on" in soak.CLUSTER_OPTIONS and "fsync=on" in soak.CLUSTER_OPTIONS
    stats = {**STATS, "last_autovacuum": "21:26:15"}
    row = soak.aggregate(0, 0, 10, [1.0], produced=1, pruned=0, stats=stats, rss_mb=1, load="0")
    assert "| 2/1 | 21:26:15 |" in soak.render(row)
    never = soak.aggregate(0, 0, 10, [1.0], produced=1, pruned=0, stats=STATS, rss_mb=1, load="0")
    assert "| 2/1 | - |" in soak.render(never)
    assert soak.AUTOVACUUM_LINE.search(
        'LOG:  automatic vacuum of table "durable_soak.public.durable_timer": index scans: 1'
    )
