"""The distribution maps the top-level folders into one `shuili` namespace, in a wheel too."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"shuili.core": "core", "shuili.hal": "hal", "shuili.platforms": "platforms",
          "shuili.conformance": "conformance"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_folder_is_listed_in_pyproject():
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_wheel_installs_one_namespace_and_nothing_named_core(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("shuili-*.whl"))
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert all(t == "shuili" or t.endswith(".dist-info") for t in tops), tops
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    assert not (target / "core").exists() and not (target / "hal").exists()
    code = ("import shuili, shuili.core, shuili.hal, shuili.platforms.reference.plugin, shuili.cli;"
            "import sys; root = sys.argv[1];"
            "assert all(m.__file__.startswith(root) for m in (shuili.core, shuili.hal)), shuili.core.__file__;"
            "from shuili.hal.cli import describe; d = describe();"
            "assert any(p['name'] == 'reference' and p['available'] for p in d['platforms']);"
            # the compiled loops' sources ship in the wheel (native.py builds them on first use)
            "from shuili.platforms.reference import native;"
            "assert all((native._DIR / src).is_file() for src, _ in native._LIBS.values()), native._DIR;"
            "assert (native._DIR / 'numerics.h').is_file(), 'the shared header is missing from the wheel'")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    # run from an empty folder so the source checkout cannot be imported by accident
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, cwd=tmp_path, env=env,
                   capture_output=True)
