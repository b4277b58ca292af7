"""The documentation cannot drift: the reference pages are what the code generates, every flag
`kvserve serve --help` prints is in the CLI reference, the README stays a five-minute read, and
the site builds with `mkdocs build --strict` (a broken link or anchor, a page left out of the
nav: a failure)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.entrypoints import docs_ref

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100",
            "NO_MKDOCS_2_WARNING": "1"}


@pytest.mark.parametrize("name", sorted(docs_ref.PAGES))
def test_reference_page_is_what_the_code_generates(name):
    committed = (ROOT / "docs" / "reference" / name).read_text()
    assert committed == docs_ref.PAGES[name](), (
        f"docs/reference/{name} is stale: run `python -m kvserve.entrypoints.docs_ref` and commit it")


def test_stale_pages_names_a_changed_page(tmp_path):
    for name, make in docs_ref.PAGES.items():
        (tmp_path / name).write_text(make())
    assert docs_ref.stale_pages(tmp_path) == []
    (tmp_path / "cli.md").write_text("# out of date\n")
    assert docs_ref.stale_pages(tmp_path) == ["cli.md"]


def test_every_serve_flag_is_in_the_cli_reference():
    helped = subprocess.run(
        [sys.executable, "-c", "import sys; from kvserve.entrypoints.cli import main; sys.exit(main())",
         "serve", "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    # The option lines: "  --kv-cache-dtype {auto,...}  help", "  --tensor-parallel-size ..., -tp"
    invocations = [line.strip().split("  ")[0] for line in helped.stdout.splitlines()
                   if line.startswith("  -")]
    flags = {f for inv in invocations for f in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", inv)}
    assert {"--block-size", "--kv-cache-dtype", "--api-key", "-tp", "--no-enforce-eager"} <= flags
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    documented = set(re.findall(r"`(--?[a-zA-Z][\w-]*)", reference))
    assert flags - {"-h", "--help"} <= documented, sorted(flags - documented)


def test_engine_reference_names_every_field():
    from dataclasses import fields

    from kvserve.config import EngineConfig

    page = (ROOT / "docs" / "reference" / "engine_args.md").read_text()
    assert all(f"| `{f.name}` |" in page for f in fields(EngineConfig))


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= 200
    assert lines[2] == "```bash"
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test ")


def test_mkdocs_build_strict(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_layout_names_every_module():
    layout = (ROOT / "docs" / "layout.md").read_text()
    sources = [p for ext in ("*.py", "*.cpp", "*.h") for p in (ROOT / "kvserve").rglob(ext)
               if p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(ROOT)) for p in sources if p.name not in layout)
    assert not missing, f"docs/layout.md does not say what these hold: {missing}"
