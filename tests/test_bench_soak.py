"""`kvserve bench soak` (kvserve/bench/soak.py): the verdict and the plot from a rounds.csv
(--from-csv, no server), the slope against numpy's least squares, flat and growing runs told
apart. The server side (rounds of streams with aborts) is the docs/soak.md run: 30 minutes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.bench import soak
from kvserve.entrypoints.cli import main


def rounds(rss_kb: list[int]) -> list[soak.Round]:
    return [soak.Round(i + 1, 10.0 * (i + 1), 1.0, 200, 50, 0, kb, kb // 2, max(rss_kb), 30)
            for i, kb in enumerate(rss_kb)]


def test_slope_is_least_squares():
    rng = np.random.default_rng(0)
    xs, ys = list(range(20)), list(rng.normal(1000, 50, 20))
    assert soak.slope(xs, ys) == pytest.approx(np.polyfit(xs, ys, 1)[0])


@pytest.mark.parametrize("growth,flat,status", [(0, True, 0), (1000, False, 1)])
def test_from_csv_gives_the_verdict_and_plot(tmp_path, growth, flat, status):
    rss = [100_000 + (5 * i if i < 3 else 0) + growth * i for i in range(12)]
    csv = tmp_path / "rounds.csv"
    soak.write_rounds(rounds(rss), csv)
    assert [r.rss_kb for r in soak.read_rounds(csv)] == rss
    out = tmp_path / "out"
    assert main(["bench", "soak", "--from-csv", str(csv), "--out-dir", str(out),
                 "--warmup-rounds", "3"]) == status
    summary = json.loads((out / "summary.json").read_text())
    assert summary["flat"] is flat
    assert summary["rss_warmup_end_kb"] == rss[2] and summary["rss_end_kb"] == rss[-1]
    want = np.polyfit(range(4, 13), rss[3:], 1)[0]
    assert summary["slope_kb_per_round"] == pytest.approx(want, abs=1e-6)
    assert (out / "soak_rss.png").stat().st_size > 0
