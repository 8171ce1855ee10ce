"""The API's docstrings: every public callable of ``jaxpipe`` that takes parameters documents them in a
Google-style section (Args / Attributes), no docstring cites an issue tracker, and nothing a user reads names
a path outside the repository."""

import ast
import dataclasses
import inspect
import os
import re

import jaxpipe as jp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"data", "models", "optim", "training", "schedules", "tune"}


def _with_methods(name, obj):
    yield name, obj
    if inspect.isclass(obj):
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        for attr, value in vars(obj).items():
            if not attr.startswith("_") and callable(value) and attr not in fields:
                yield f"{name}.{attr}", value


def _public_callables():
    """Every name of ``jaxpipe.__all__`` and of the public modules users import (their ``__all__``, or their
    public names defined in jaxpipe), with a class's own public methods."""
    for name in jp.__all__:
        if name not in MODULES:
            yield from _with_methods(name, getattr(jp, name))
    for module_name in sorted(MODULES):
        module = getattr(jp, module_name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if callable(obj) and getattr(obj, "__module__", "").startswith("jaxpipe"):
                yield from _with_methods(f"{module_name}.{name}", obj)


def test_every_public_callable_documents_its_parameters():
    missing = []
    for name, obj in _public_callables():
        try:
            params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        except (TypeError, ValueError):
            params = []
        doc = inspect.getdoc(obj) or ""
        if params and not re.search(r"^(Args|Attributes):$", doc, re.M):
            missing.append(name)
    assert not missing, f"add an Args: (or Attributes:) section to {missing}"


def _docstrings(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", "<module>"), doc


def test_no_docstring_cites_an_issue_number():
    cited = []
    for folder in ("jaxpipe", "experiments"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(base, f)
                    cited += [
                        f"{os.path.relpath(path, ROOT)}:{name}"
                        for name, doc in _docstrings(path)
                        if re.search(r"issues? #\d+|\(#\d+", doc)
                    ]
    assert not cited, cited


def test_nothing_a_user_reads_names_a_path_outside_the_repository():
    pages = ["README.md", "CHANGELOG.md"] + [
        os.path.join(base, f)
        for folder in ("docs", "jaxpipe", "experiments", "examples")
        for base, _, files in os.walk(os.path.join(ROOT, folder))
        for f in files
        if f.endswith((".md", ".py")) and "_build" not in base
    ]
    outside = []
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        outside += [
            f"{os.path.relpath(os.path.join(ROOT, page), ROOT)}: {m}"
            for m in re.findall(r"\.\./shared\S*", text)
        ]
    assert not outside, outside


def _comment_blocks(lines):
    """``(first line index, [comment texts])`` of each run of comment lines with one indent and prefix."""
    block, start, key = [], 0, None
    for i, line in enumerate(lines + [""]):
        m = re.match(r"^(\s*)(#:?)(?: (.*)|$)", line)
        this = (m.group(1), m.group(2)) if m else None
        if this != key and block:
            yield start, block
            block = []
        if m:
            start, key = (i, this) if not block else (start, key)
            block.append(m.group(3) or "")
        key = this


def test_no_comment_is_broken_mid_sentence():
    """A comment wrapped at the line limit carries its words on: a line of a word or two between two
    comment lines is the trace of a reflow that broke it (``# ... keep them`` / ``# all`` / ``# (a second
    run ...``), which a reader takes for a heading or a lost fragment."""
    broken = []
    for folder in ("jaxpipe", "experiments", "tests"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(base, f)
                lines = open(path).read().split("\n")
                for start, texts in _comment_blocks(lines):
                    for k in range(1, len(texts) - 1):
                        if 0 < len(texts[k].strip()) <= 12 and len(lines[start + k - 1]) >= 100:
                            broken.append(f"{os.path.relpath(path, ROOT)}:{start + k + 1}: {texts[k]!r}")
    assert not broken, broken
