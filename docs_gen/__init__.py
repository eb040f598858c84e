"""Generator of normspec's documentation site (not part of the installed package).

`hooks.py` is the MkDocs hook file named in `mkdocs.yml`; the other modules are
plain functions that turn the spec, the registry, the committed reports and the
committed benchmark results into Markdown (and PNG) pages. They import MkDocs
only in `hooks.py`, so the tests can exercise them without MkDocs installed.
"""
