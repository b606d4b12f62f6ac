"""The distribution as a user installs it: one import package named after it, and nothing else at the
top of site-packages (a generic `core` or `dashboard` beside it would break, or be broken by, any other
project with the same name)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from builders import REPO


def _build_wheel(tmp_path: Path) -> Path:
    """Build from the tracked files alone, as a fresh clone would, so nothing untracked slips in."""
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in filter(None, tracked):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def test_the_wheel_holds_one_top_level_package_named_after_the_distribution(tmp_path):
    from logprob_parity import __version__

    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"logprob_parity", f"logprob_parity-{__version__}.dist-info"}, sorted(top)
    # every stage is inside it, with the data the demo prompts and floors read
    for sub in ("inputs", "engines", "engines/backends", "analysis", "results", "present", "dashboard", "dashboard/views"):
        assert f"logprob_parity/{sub}/__init__.py" in names, sub
    assert "logprob_parity/cli.py" in names and "logprob_parity/__main__.py" in names
    assert "logprob_parity/data/sentences.txt" in names
    entry_points = zipfile.ZipFile(wheel).read(f"logprob_parity-{__version__}.dist-info/entry_points.txt").decode()
    assert "logprob-parity = logprob_parity.cli:main" in entry_points


def test_python_dash_m_and_version_name_the_package_and_the_engines_libraries():
    from logprob_parity.env import versions

    out = subprocess.run(
        [sys.executable, "-m", "logprob_parity", "--version"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.strip()
    from logprob_parity import __version__

    assert out.startswith(f"logprob-parity {__version__}")
    found = versions()
    for key in ("transformers", "torch"):
        assert found[key] and f"{key} {found[key]}" in out, (key, out)
    if found["vllm"]:
        assert f"{found['vllm_dist']} {found['vllm']}" in out, out


FIXTURE = Path(__file__).resolve().parent / "data" / "store-before-rename"


def test_runs_and_rollouts_stored_before_the_rename_open_with_the_same_values(tmp_path):
    """The store was written by the `core` package before the rename (see dump.py there); every value
    the old code read back, the renamed package reads back too."""
    home = tmp_path / "home"
    shutil.copytree(FIXTURE, home, ignore=shutil.ignore_patterns("*.json", "*.py"))
    got = subprocess.run(
        [sys.executable, str(FIXTURE / "dump.py"), str(REPO), str(home)], capture_output=True, text=True, check=True
    ).stdout
    assert got == (FIXTURE / "expected.json").read_text()


def test_stored_records_name_no_module_paths():
    """Nothing the store writes (Parquet metadata, index rows) names a module, so a rename cannot orphan it."""
    import sqlite3

    import pyarrow.parquet as pq

    texts = []
    for path in FIXTURE.rglob("*.parquet"):
        texts += [v.decode("utf-8", "replace") for v in (pq.read_schema(path).metadata or {}).values()]
    with sqlite3.connect(FIXTURE / "index.sqlite") as db:
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            texts += [repr(row) for row in db.execute(f"SELECT * FROM {table}")]
    assert texts and any("25e6e5bff22f4a779cb2" in t for t in texts)
    for pattern in ("core.", "core/", "dashboard.", "logprob_parity.", "__module__", "py/object"):
        assert not any(pattern in t for t in texts), pattern
