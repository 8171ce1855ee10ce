"""BUILD_NOTES.md is the project's memory, not its diary: at most 1,500 lines, sections by subsystem (no dated
stop logs), no path outside the repository, and every file it names exists."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = open(os.path.join(ROOT, "BUILD_NOTES.md")).read()
#: where a file named by its path inside a package is looked for
FOLDERS = ("", "jaxpipe", "tests", "experiments", "docs")
SUFFIXES = ("py", "md", "toml", "txt", "cfg", "sh", "png")


def test_it_is_at_most_1500_lines_by_subsystem():
    assert len(TEXT.splitlines()) <= 1500
    headings = re.findall(r"^## (.*)$", TEXT, re.M)
    assert headings, "no sections"
    diary = [h for h in headings if re.search(r"\bstop\b|20\d\d-\d\d-\d\d", h)]
    assert not diary, f"sections named by a date or a stop, not a subsystem: {diary}"


def test_no_path_outside_the_repository():
    assert not re.findall(r"\.\./\S+", TEXT)


def named_files(text):
    """The file names in ``text``: paths with a known suffix, and folders of the repository given with a
    slash (``jaxpipe/cuts/``)."""
    names = set(re.findall(r"(?<![\w./$~:-])((?:\.?[\w-]+/)*[\w-]+\.(?:%s))\b" % "|".join(SUFFIXES), text))
    names |= set(re.findall(r"(?<!:)`((?:jaxpipe|experiments|tests|docs|examples)/[\w/.-]*)`", text))
    return sorted(n.split("::")[0] for n in names)


def test_every_file_it_names_exists():
    missing = [
        name
        for name in named_files(TEXT)
        if not any(os.path.exists(os.path.join(ROOT, folder, name)) for folder in FOLDERS)
    ]
    assert not missing, f"BUILD_NOTES.md names files that do not exist: {missing}"


def test_the_name_check_sees_a_missing_file():
    assert named_files("see `runtime/async_executor.py` and jaxpipe/cuts.py") == [
        "jaxpipe/cuts.py",
        "runtime/async_executor.py",
    ]


def test_every_section_the_code_and_docs_cite_exists():
    """A docstring, comment or page that cites ``BUILD_NOTES, "Section"`` names a section this file has."""
    headings = " | ".join(re.findall(r"^#+ (.*)$", TEXT, re.M))
    cited = []
    for folder in ("jaxpipe", "experiments", "tests", "docs"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith((".py", ".md")) and f != "test_build_notes.py":
                    text = open(os.path.join(base, f)).read()
                    for name in re.findall(r'BUILD_NOTES(?:\.md)?,?\s+"([^"]+)"', text):
                        cited.append((f, " ".join(name.split())))
    missing = [(f, name) for f, name in cited if name not in headings]
    assert cited and not missing, missing
