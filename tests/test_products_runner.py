"""``experiments.products`` runs end to end at a small size and prints every product under each kernel."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_products_runner_prints_each_product_under_each_kernel():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.products", "--rows=8", "--width=64", "--layers=2", "--number=1"],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("work"))
    assert "XLA default" in lines[header]
    rows = {line[:34].strip(): line[34:].split() for line in lines[header + 1 :]}
    for work in ("forward h @ W", "weight h.T @ g", "input g @ W.T", "2 layers forward and backward"):
        assert work in rows and rows[work] and all(float(t) > 0 for t in rows[work]), out.stdout
