"""Sphinx configuration for Narwhal's user documentation."""

import sys
from pathlib import Path

# Build from a checkout even when the package is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import narwhal

project = "Narwhal"
author = "The Narwhal maintainers"
copyright = "the Narwhal maintainers"
version = narwhal.__version__
release = narwhal.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

exclude_patterns = ["_build"]
default_role = "literal"
highlight_language = "none"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"Narwhal {release}"
html_theme_options = {"description": "An admission router for LLM inference"}
