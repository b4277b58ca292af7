"""The figures pages cannot drift from the result records: the committed pages are what
`python -m benchmarks.lab.figures` renders from docs/figures/data/, a record without its date,
machine, command or peer is refused, a record the benchmarks write reads back the same, and a
made-up record's values appear in its table. (tests/test_docs.py builds the site with
`mkdocs build --strict`, which the Figures nav is part of.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.lab import figures
from kvserve.bench.record import (REQUIRED, Record, RecordError, Row, load_record, parse_record,
                                  write_record)

ROOT = Path(__file__).resolve().parent.parent


def _record(**over) -> dict:
    base = {"area": "made-up", "title": "A made-up run", "date": "2031-02-03",
            "machine": "Test CPU (2 logical CPUs) | AVX2 yes", "command": "python bench_x.py --n 3",
            "peer": "nobody 1.0", "notes": "Written by the test.",
            "rows": [{"figure": "decode speed", "unit": "tok/s", "kvserve": 123.4,
                      "peer": 61.7, "ratio": 2.0, "target": ">= 1.5x", "met": True},
                     {"figure": "peak memory", "unit": "MB", "kvserve": 2048, "peer": 1024.5,
                      "ratio": 1.999, "target": "<= 1.0x", "met": False},
                     {"figure": "spread", "unit": "ms", "kvserve": "17 [12-20]"}]}
    base.update(over)
    return base


def test_committed_pages_are_what_the_records_render():
    stale = figures.stale(mkdocs=ROOT / "mkdocs.yml")
    assert not stale, "\n".join(stale)


def test_check_names_a_stale_page_and_plot(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(figures.DATA, data)
    out = tmp_path / "out"
    figures.write(out, data)
    assert figures.stale(out, data) == []
    path = data / "serving" / "serve-llamacpp-1b.json"
    rec = json.loads(path.read_text())
    rec["rows"][0]["ratio"] = 9.99
    path.write_text(json.dumps(rec))
    assert sorted(figures.stale(out, data)) == [
        "docs/figures/serving.md is stale: run python -m benchmarks.lab.figures",
        "docs/figures/serving.png is stale: run python -m benchmarks.lab.figures"]
    path.unlink()
    (data / "serving" / "serve-llamacpp-8b.json").unlink()
    (data / "serving" / "bench-serve.json").unlink()
    assert "docs/figures/serving.md has no records: run python -m benchmarks.lab.figures " \
        "(it removes it)" in figures.stale(out, data)


def test_rendering_is_deterministic(tmp_path):
    data = tmp_path / "data"
    (data / "made-up").mkdir(parents=True)
    (data / "made-up" / "x.json").write_text(json.dumps(_record()))
    first, second = tmp_path / "a", tmp_path / "b"
    figures.write(first, data)
    figures.write(second, data)
    for name in ("index.md", "made-up.md", "made-up.png"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.parametrize("missing", ["date", "machine", "command", "peer"])
def test_a_record_without_its_context_is_refused(missing):
    with pytest.raises(RecordError, match=f"missing {missing}"):
        parse_record(_record(**{missing: ""}), "x.json")
    rec = _record()
    del rec[missing]
    with pytest.raises(RecordError, match=f"x.json: missing {missing}"):
        parse_record(rec, "x.json")


def test_the_renderer_refuses_a_bad_record_with_its_path(tmp_path):
    (tmp_path / "made-up").mkdir()
    (tmp_path / "made-up" / "bad.json").write_text(json.dumps(_record(peer=None)))
    with pytest.raises(RecordError, match=r"bad.json: missing peer"):
        figures.load_records(tmp_path)


def test_wrong_values_are_refused():
    with pytest.raises(RecordError, match="ratio"):
        parse_record(_record(rows=[{"figure": "f", "ratio": "2x"}]))
    with pytest.raises(RecordError, match="met"):
        parse_record(_record(rows=[{"figure": "f", "met": "yes"}]))
    with pytest.raises(RecordError, match="kvserve"):
        parse_record(_record(rows=[{"figure": "f", "kvserve": True}]))
    with pytest.raises(RecordError, match="date"):
        parse_record(_record(date="6 Dec 2026"))
    with pytest.raises(RecordError, match="no rows"):
        parse_record(_record(rows=[]))
    assert REQUIRED == ("area", "title", "date", "machine", "command", "peer")


def test_write_record_round_trips(tmp_path):
    path = write_record(tmp_path / "made-up" / "run.json", title="T", peer="P", when="2031-02-03",
                        machine="M", command="python bench.py --record",
                        rows=[Row("speed", "tok/s", 10.5, 5.25, 2.0, ">= 1.5x", True),
                              {"figure": "text", "kvserve": "a | b"}], notes="N")
    rec = load_record(path)
    assert rec == Record(area="made-up", title="T", date="2031-02-03", machine="M",
                         command="python bench.py --record", peer="P", notes="N",
                         rows=[Row("speed", "tok/s", 10.5, 5.25, 2.0, ">= 1.5x", True),
                               Row("text", kvserve="a | b")])


def test_write_record_to_an_area_fills_in_this_machine_and_command(tmp_path, monkeypatch):
    import kvserve.bench.record as record

    monkeypatch.setattr(record, "DATA", tmp_path)
    monkeypatch.setattr("sys.argv", ["benchmarks/bench_x.py", "--repeats", "3", "--record"])
    path = write_record("made-up", title="T", peer="P", rows=[Row("f", ratio=1.0)])
    assert path == tmp_path / "made-up" / "bench-x.json"
    rec = load_record(path)
    assert rec.command == "python benchmarks/bench_x.py --repeats 3 --record"
    assert "(" in rec.machine and "AVX2" in rec.machine  # cpu_info().flags_line()


def test_a_made_up_record_shows_its_values(tmp_path):
    (tmp_path / "made-up").mkdir()
    (tmp_path / "made-up" / "x.json").write_text(json.dumps(_record()))
    page = figures.area_page("made-up", figures.load_records(tmp_path)["made-up"])
    lines = page.splitlines()
    # Read the table as a reader does: cells between pipes, by column name.
    start = lines.index("| figure | unit | kvserve | peer | ratio | target | met |")
    table = [[c.strip() for c in line.strip("|").split("|")]
             for line in lines[start + 2:] if line.startswith("|")]
    assert table == [["decode speed", "tok/s", "123.4", "61.7", "2.0x", "&gt;= 1.5x", "**met**"],
                     ["peak memory", "MB", "2,048", "1,024.5", "1.999x", "&lt;= 1.0x", "not met"],
                     ["spread", "ms", "17 \\[12-20\\]", "–", "–", "–", "–"]]
    assert "- **date:** 2031-02-03" in lines
    assert "- **machine:** Test CPU (2 logical CPUs) \\| AVX2 yes" in lines
    assert "- **command:** `python bench_x.py --n 3`" in lines
    assert "- **peer:** nobody 1.0" in lines
    assert lines.index("Written by the test.") > start
    assert "![ratios against the peer: Made up](made-up.png)" in lines


def test_plot_carries_its_stamp(tmp_path):
    recs = [("x", parse_record(_record()))]
    assert figures.plot_area("made-up", recs, tmp_path / "p.png")
    assert figures.png_description(tmp_path / "p.png") == figures.plot_stamp("made-up", recs)
    other = [("x", parse_record(_record(rows=[{"figure": "decode speed", "ratio": 2.5}])))]
    assert figures.plot_stamp("made-up", other) != figures.plot_stamp("made-up", recs)


def test_every_area_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for area in figures.load_records():
        assert f"figures/{area}.md" in nav


def test_record_flag_takes_a_json_path_or_an_area():
    import argparse

    from kvserve.bench.record import add_record_arg

    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="*")
    add_record_arg(p, "startup-memory")
    assert p.parse_args([]).record is None
    assert p.parse_args(["--record"]).record == "startup-memory"
    assert p.parse_args(["--record", "out/run.json"]).record == "out/run.json"
    with pytest.raises(SystemExit):
        p.parse_args(["--record", "Q4_K_M.gguf"])
