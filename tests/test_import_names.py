"""The repository's folders never shadow installed packages of the same top-level name.

The root is on sys.path in the tests (pytest's ``pythonpath``) and in scripts run from a checkout,
where ``kernels/`` would otherwise be imported as Hugging Face's ``kernels`` package, which
transformers >= 5.25 imports (kernels/__init__.py).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_from_root(code, *flags):
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_top_level_kernels_is_hugging_faces_package():
    code = ("import kernels, dayzero.kernels as ours; from transformers.integrations import hub_kernels; "
            "print(kernels.__file__); print(ours.flash_attention.__module__)")
    proc = _run_from_root(code)
    assert proc.returncode == 0, proc.stderr
    hub_file, ours = proc.stdout.split()
    assert Path(hub_file).resolve().parent != ROOT / "kernels", hub_file
    assert ours == "dayzero.kernels.flash_attention"


def test_missing_hub_package_is_a_clear_error():
    # -S: no site-packages, so Hugging Face's package cannot be found; only the checkout is on sys.path.
    proc = _run_from_root("import kernels", "-S")
    assert proc.returncode != 0
    assert "'kernels' is Hugging Face's package, which is not installed" in proc.stderr
    assert "dayzero.kernels" in proc.stderr
