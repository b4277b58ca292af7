"""A benchmark run's figures as one small JSON record, the input of the figures pages.

docs/benchmarks.md (retired by issue 51) grew into a lab notebook: every pass appended, and a
reader could not tell which figure is today's. A record holds one run's current figures with
what makes them readable on their own: the date, the machine (CPU model and SIMD flags), the
exact command and the peer it was measured against. `python -m benchmarks.lab.figures` renders
every record under docs/figures/data/<area>/ into one page per area; a newer run of the same
benchmark overwrites its record, so the page shows the current figure and git keeps the history.

    {"area": "prefix-caching", "title": "...", "date": "2026-11-30",
     "machine": "AMD EPYC (2 logical CPUs) | AVX2 yes, ...", "command": "python ...",
     "peer": "transformers 5.24", "notes": "...",
     "rows": [{"figure": "TTFT at 2,048 tokens", "unit": "ms", "kvserve": 32.8,
               "peer": 558, "ratio": 0.059, "target": "<= 0.1x", "met": true}]}

A benchmark writes one with `write_record(args.record, ...)` after `add_record_arg(parser)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "docs" / "figures" / "data"
# What a reader needs to trust a figure; a record without one of them is refused.
REQUIRED = ("area", "title", "date", "machine", "command", "peer")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class RecordError(ValueError):
    """A record that cannot be rendered: the message names the file and the field."""


@dataclass
class Row:
    """One figure: kvserve's value beside the peer's (or the baseline's) and their ratio.
    Values may be text where the source states them with ranges or words."""

    figure: str
    unit: str = ""
    kvserve: float | str | None = None
    peer: float | str | None = None
    ratio: float | None = None
    target: str | None = None  # as the issue states it, e.g. ">= 1.5x"
    met: bool | None = None  # None: no target, or not decided


@dataclass
class Record:
    area: str
    title: str
    date: str  # ISO: 2026-12-05 or 2026-12-05T14:54
    machine: str
    command: str
    peer: str
    rows: list[Row] = field(default_factory=list)
    notes: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, ensure_ascii=False) + "\n"


def _check_value(where: str, name: str, value, kinds: tuple) -> None:
    """bool is an int to Python; a table cell that says True is still a wrong record."""
    if value is None:
        return
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise RecordError(f"{where}: {name} must be {' or '.join(k.__name__ for k in kinds)}, "
                          f"not {value!r}")


def parse_record(data: dict, where: str = "record") -> Record:
    """A Record from its JSON object, or RecordError naming what is missing or wrong."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: a record is a JSON object")
    missing = [k for k in REQUIRED if not str(data.get(k) or "").strip()]
    if missing:
        raise RecordError(f"{where}: missing {', '.join(missing)} (every record states "
                          f"{', '.join(REQUIRED)})")
    unknown = set(data) - {f.name for f in dataclasses.fields(Record)}
    if unknown:
        raise RecordError(f"{where}: unknown fields {sorted(unknown)}")
    if not _SLUG.match(data["area"]):
        raise RecordError(f"{where}: area {data['area']!r} is not a slug (a-z, 0-9, -)")
    try:
        datetime.fromisoformat(data["date"])
    except (TypeError, ValueError):
        raise RecordError(f"{where}: date {data['date']!r} is not ISO (2026-12-05)") from None
    rows = []
    for i, r in enumerate(data.get("rows") or []):
        at = f"{where}: rows[{i}]"
        if not isinstance(r, dict) or not str(r.get("figure") or "").strip():
            raise RecordError(f"{at}: every row names its figure")
        unknown = set(r) - {f.name for f in dataclasses.fields(Row)}
        if unknown:
            raise RecordError(f"{at}: unknown fields {sorted(unknown)}")
        for name in ("kvserve", "peer"):
            _check_value(at, name, r.get(name), (int, float, str))
        _check_value(at, "ratio", r.get("ratio"), (int, float))
        _check_value(at, "met", r.get("met"), (bool,))
        rows.append(Row(**r))
    if not rows:
        raise RecordError(f"{where}: no rows")
    fields = {k: data[k] for k in REQUIRED}
    return Record(**fields, rows=rows, notes=data.get("notes") or "")


def load_record(path: Path) -> Record:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON ({e})") from None
    return parse_record(data, str(path))


def current_machine() -> str:
    """This CPU's model and SIMD flags, as the benchmarks print them."""
    from kvserve.kernels.cpu.cpu_features import cpu_info

    return cpu_info().flags_line()


def current_command() -> str:
    """The command line that is running, as a user would retype it."""
    return shlex.join(["python", *sys.argv])


def _row(r) -> Row:
    return r if isinstance(r, Row) else Row(**r)


def write_record(path_or_area: str | Path, *, title: str, peer: str, rows: list,
                 notes: str = "", command: str | None = None, machine: str | None = None,
                 when: str | None = None, area: str | None = None,
                 name: str | None = None) -> Path:
    """Write one run's figures. `path_or_area` is a .json path or an area slug (the record
    then goes to docs/figures/data/<area>/<name>.json, name defaulting to the script's, so
    that a re-run replaces its record).
    The machine, command and date default to this process's. Validated before writing, so a
    record that the figures script would refuse is never written."""
    target = Path(path_or_area)
    if target.suffix != ".json":
        area = area or str(path_or_area)
        stem = name or Path(sys.argv[0]).stem.replace("_", "-") or "record"
        target = DATA / area / f"{stem}.json"
    area = area or target.parent.name
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M")  # UTC, to the minute
    record = Record(area=area, title=title, date=when or now,
                    machine=machine or current_machine(), command=command or current_command(),
                    peer=peer, rows=[_row(r) for r in rows], notes=notes)
    parse_record(json.loads(record.to_json()), str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(record.to_json(), encoding="utf-8")
    print(f"wrote {target}", file=sys.stderr)
    return target


def record_target(value: str) -> str:
    """--record's value: a .json path or an area slug. Checked when the flags are parsed, not
    after the run: `--record FILE.gguf` (a positional swallowed) fails at once."""
    if value.endswith(".json") or _SLUG.match(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a .json path nor an area name "
                                     "(a-z, 0-9, -)")


def add_record_arg(parser, area: str) -> None:
    """--record [PATH]: write the run's figures as a record (default: the area's directory
    under docs/figures/data/, named after the script)."""
    parser.add_argument("--record", nargs="?", const=area, default=None, metavar="PATH",
                        type=record_target,
                        help="write the figures as a record for the figures pages: a .json "
                             f"path, or with no value docs/figures/data/{area}/ "
                             "(then run python -m benchmarks.lab.figures)")


def ratio(a, b) -> float | None:
    """a / b rounded for a table, or None where either is missing or b is zero."""
    try:
        return round(float(a) / float(b), 3) if float(b) else None
    except (TypeError, ValueError):
        return None
