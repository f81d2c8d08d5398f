"""The source tree keeps its own rules: generated files current, the README's tables from the results files, the two
kernel families siblings, and project text that speaks of the product (versions and dates, not how it was made)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".whl", ".gpu_carry"}


def _text_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts) or not path.is_file():
            continue
        if path.suffix in {".py", ".cu", ".cuh", ".h", ".cc", ".md", ".toml", ".txt", ".sh", ".json"} or \
                path.name in {"run", "CMakeLists.txt"}:
            yield rel, path.read_text(errors="replace")


def test_readme_tables_come_from_the_results_files():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_table.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_project_text_names_versions_and_dates():
    # (the words are assembled, so this file passes its own check)
    pattern = re.compile("|".join(("sess" + "ion", "a/b" + " run", "iss" + r"ue[- ]?[0-9]")), re.IGNORECASE)
    found = [f"{rel}:{n}: {line.strip()[:80]}" for rel, text in _text_files()
             for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found[:20])


def test_kernel_families_do_not_include_each_other():
    for family, other in (("sm80", "sm90"), ("sm90", "sm80")):
        for path in (ROOT / "csrc" / family).iterdir():
            includes = re.findall(r'#include "([^"]+)"', path.read_text())
            assert not [i for i in includes if i.startswith(other + "/")], f"{path} includes the {other} family"


def test_no_experiment_switches_in_shipped_code():
    found = [f"{rel}" for rel, text in _text_files() if rel.parts[0] in ("csrc", "ffi", "jax_flash")
             for line in text.splitlines() if re.search(r"JAX_FLASH_AB_|getenv\(", line)]
    assert not found, found
