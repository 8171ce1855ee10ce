"""The API's docstrings: every public callable of ``jaxpipe`` that takes parameters documents them in a
Google-style section (Args / Attributes), no docstring cites an issue tracker, and nothing a user reads names
a path outside the repository."""

import ast
import inspect
import os
import re

import jaxpipe as jp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {"data", "models", "optim", "training", "schedules", "tune"}


def _public_callables():
    for name in jp.__all__:
        if name in MODULES:
            continue
        obj = getattr(jp, name)
        yield name, obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and callable(value):
                    yield f"{name}.{attr}", value


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
