"""The documentation site builds warning-free (``sphinx-build -W --keep-going``), and its API reference has
every public name of ``jaxpipe.__all__`` with its signature."""

import os
import re
import subprocess
import sys

import pytest

import jaxpipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.ci_once
def test_the_site_builds_warning_free_with_every_public_name(tmp_path):
    out = tmp_path / "html"
    p = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out)],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    pages = "".join((out / "api" / f).read_text() for f in os.listdir(out / "api") if f.endswith(".html"))
    documented = set(re.findall(r'id="(jaxpipe\.[A-Za-z_.]+)"', pages))
    modules = {"data", "models", "optim", "training", "schedules", "tune"}
    missing = [
        n
        for n in jaxpipe.__all__
        if (n in modules and not any(d.startswith(f"jaxpipe.{n}.") for d in documented))
        or (n not in modules and f"jaxpipe.{n}" not in documented)
    ]
    assert not missing, f"public names without an API entry: {missing}"
    assert "jaxpipe.Pipeline.step" in documented and "jaxpipe.schedules.Schedule" in documented


def test_every_benchmark_section_says_when_and_how():
    """Each measured section of the benchmarks page names its date and the command that reproduces it (the
    testbeds section defines the machines and versions the sections refer to); the summary at the top only
    points into them, every link to a label that stands before a section heading."""
    import re

    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    sections = re.split(r"^#{2,3} ", text, flags=re.M)[1:]
    assert sections[0].startswith("Where jaxpipe stands, at a glance")
    links = re.findall(r"\]\(#([\w-]+)\)", sections[0])
    assert len(links) >= 5, links
    for label in links:
        assert re.search(rf"^\({label}\)=\n#{{2,3}} .*20\d\d-\d\d-\d\d", text, flags=re.M), label
    assert sections[1].startswith("Testbeds and versions")
    for section in sections[2:]:
        title = section.splitlines()[0]
        assert re.search(r"20\d\d-\d\d-\d\d", section), f"benchmarks section {title!r} has no date"
        assert re.search(r"`(python -m |jaxpipe |git |CI=true )", section), f"{title!r} has no command"
