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
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as a field list (autodoc documents the fields themselves too)

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["jaxpipe.css"]
html_title = f"jaxpipe {version}"
html_theme_options = {
    "repository_url": "https://github.com/jaxpipe/jaxpipe",
    "use_repository_button": False,
    "show_toc_level": 2,
}
