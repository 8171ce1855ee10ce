"""Sphinx configuration of jaxpipe's documentation site: ``sphinx-build -W --keep-going docs docs/_build``."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxpipe  # noqa: E402

project = "jaxpipe"
author = "the jaxpipe authors"
release = version = jaxpipe.__version__
copyright = "2026, the jaxpipe authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# types only where a parameter is documented: a dataclass's fields are its Attributes, not a second
# Parameters list
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as a field list (autodoc documents the fields themselves too)


def _skip_dataclass_fields(app, what, name, obj, skip, options):
    """A dataclass's fields are described once, in its Attributes section: not again as bare members."""

    if what == "class" and getattr(obj, "__class__", None) is not None:
        owner = _DATACLASS_FIELDS.get(name)
        if owner and (not callable(obj) or getattr(obj, "__name__", "") == "<lambda>"):
            return True
    return skip


def _dataclass_fields():
    import dataclasses
    import inspect

    import jaxpipe.schedules
    import jaxpipe.training
    import jaxpipe.tune

    names = {}
    for module in (jaxpipe, jaxpipe.schedules, jaxpipe.tune, jaxpipe.training):
        for value in vars(module).values():
            if inspect.isclass(value) and dataclasses.is_dataclass(value) and value.__doc__:
                if "Attributes:" in value.__doc__:
                    for field in dataclasses.fields(value):
                        names[field.name] = value
    return names


_DATACLASS_FIELDS = {}


def setup(app):
    _DATACLASS_FIELDS.update(_dataclass_fields())
    app.connect("autodoc-skip-member", _skip_dataclass_fields)


html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["jaxpipe.css"]
html_title = f"jaxpipe {version}"
html_theme_options = {
    "repository_url": "https://github.com/jaxpipe/jaxpipe",
    "use_repository_button": False,
    "show_toc_level": 2,
}
