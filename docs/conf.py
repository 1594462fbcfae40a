"""Sphinx configuration of the jax_ncclx documentation: Markdown pages (MyST) under docs/, the API reference
from the docstrings (autodoc, Google style through napoleon), and two local extensions in docs/_ext that
generate the configuration table from jax_ncclx/_src/config.py and the performance tables from
benchmarks/results/*.json at build time.

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(DOCS, "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports jax_ncclx (built, CPU suffices); no GPU needed

try:  # once here: autodoc would report each later import of a half-imported package as a riddle
    import jax_ncclx  # noqa: F401
except ImportError as error:
    raise RuntimeError(f"docs/conf.py: {error}") from None  # Sphinx prints this; a SystemExit's text it hides

project = "jax_ncclx"
author = "the jax_ncclx authors"
copyright = "the jax_ncclx authors"  # noqa: A001 - Sphinx's name

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "ncclx_config",
    "ncclx_results",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Token side", "params_style"), ("Expert side", "params_style")]  # moe.DispatchHandle

html_theme = "furo"
html_title = "jax_ncclx"
