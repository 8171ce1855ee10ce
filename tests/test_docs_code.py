"""Every Python block of Getting started and the user guide runs, as written, in the order the page gives it.

A page's blocks share one namespace (a later block uses what an earlier one defined, as a reader would type
them), in a fresh Python process per page with 8 CPU-emulated devices, in a scratch directory (a page's
checkpoints and runs land there).  What a page takes as given -- a user's own batches, a Flax model already
written -- is a Python block inside an HTML comment (``<!-- set up for the tests ... -->``): run first, not
shown.  A block that fails names its page and line.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["docs/getting_started.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "guide", "*.md"))
)
FENCE = re.compile(r"^```python\s*$")

#: runs one page's blocks in one namespace; a failure prints the block's page and line
DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for where, code in blocks:
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print("the block at", where, "failed")
        sys.exit(1)
    print("ran", where, flush=True)
"""


def python_blocks(page: str):
    """``[(page:line, code)]``: the page's Python fences, hidden set-up blocks included, in order."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(open(os.path.join(ROOT, page)).read().splitlines(), 1):
        if code is None and FENCE.match(line):
            code, start = [], number + 1
        elif code is not None and line.strip() == "```":
            blocks.append((f"{page}:{start}", "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    assert code is None, f"{page}: a Python block opened at line {start} is never closed"
    return blocks


def test_every_guide_page_is_checked():
    """The pages this file runs are the site's Getting started and every guide page it lists."""
    toc = open(os.path.join(ROOT, "docs", "index.md")).read()
    for page in PAGES:
        name = os.path.splitext(os.path.relpath(page, "docs"))[0]
        assert name in toc, f"{page} is run here but not in the site's table of contents"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_the_page_code_runs(page, tmp_path):
    blocks = python_blocks(page)
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps(blocks))
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + SUBPROCESS_XLA_FLAGS,
        MPLCONFIGDIR=str(tmp_path / "mpl"),
    )
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    assert p.stdout.count("ran ") == len(blocks)
