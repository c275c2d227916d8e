"""What `pip install pagoda` brings: serving only; plots and Locust in the `bench` extra; every
file the package reads at run time (web page, kernel sources) declared as package data."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_serving_needs_no_plotting_locust_or_browser() -> None:
    core = names(PROJECT["project"]["dependencies"])
    assert {"fastapi", "uvicorn", "torch", "prometheus-client"} <= core
    assert not {"matplotlib", "locust", "selenium", "gevent"} & core


def test_the_dev_extra_brings_the_bench_extra_and_the_browser_driver() -> None:
    extras = PROJECT["project"]["optional-dependencies"]
    assert {"matplotlib", "locust"} <= names(extras["bench"])
    assert "pagoda[bench]" in extras["dev"] and "selenium" in names(extras["dev"])


def test_every_runtime_file_is_package_data() -> None:
    patterns = PROJECT["tool"]["setuptools"]["package-data"]["pagoda"]
    package = REPO / "pagoda"
    needed = [p for p in (package / "server" / "webui" / "static").iterdir()]
    needed += [p for p in (package / "csrc").iterdir() if p.suffix in (".cpp", ".h")]
    assert any(p.name == "index.html" for p in needed)
    for path in needed:
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, pattern) for pattern in patterns), rel
