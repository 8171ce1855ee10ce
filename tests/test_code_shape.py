"""The package stays readable by two measures a reviewer applies: no function over 80 lines (its docstring
counted), and no class that reads or writes over 30 distinct ``self.<name>`` attributes (its in-package base
classes counted with it).  Pure AST: nothing is imported."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOST_LINES = 80
MOST_ATTRIBUTES = 30


def _trees():
    for folder, _, files in os.walk(os.path.join(ROOT, "jaxpipe")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), ast.parse(f.read())


def test_no_function_is_longer_than_80_lines():
    long = [
        f"{path}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _trees()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MOST_LINES
    ]
    assert not long, f"functions over {MOST_LINES} lines (split them by topic): {long}"


def test_no_class_sees_more_than_30_attributes():
    classes = {}
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                attrs = {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                }
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (attrs, methods, bases, path)

    def seen(name, stack=()):
        if name not in classes or name in stack:
            return set(), set()
        attrs, methods, bases, _ = classes[name]
        attrs, methods = set(attrs), set(methods)
        for base in bases:
            more_attrs, more_methods = seen(base, stack + (name,))
            attrs |= more_attrs
            methods |= more_methods
        return attrs, methods

    crowded = {}
    for name in classes:
        attrs, methods = seen(name)
        if len(attrs - methods) > MOST_ATTRIBUTES:
            crowded[f"{classes[name][3]}:{name}"] = len(attrs - methods)
    assert not crowded, f"classes over {MOST_ATTRIBUTES} attributes (give a part its own object): {crowded}"
