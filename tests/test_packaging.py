"""configs/ at the repository root reaches installs as the package meshtrain.configs."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_non_editable_install_finds_every_config_from_any_directory(tmp_path):
    pytest.importorskip("setuptools")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(ROOT)], check=True, capture_output=True)
    shipped = sorted(p.name for p in (target / "meshtrain" / "configs").glob("*.py"))
    assert shipped == sorted(p.name for p in (ROOT / "configs").glob("*.py"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("from meshtrain import config; print(config.CONFIG_DIR); "
             "print(config.load('llama3_8b_fsdp8_tp4').model.size)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env={"PYTHONPATH": str(target)},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [str(target / "meshtrain" / "configs"), "llama3_8b"]
