"""The package's one compiled part, which pyproject.toml cannot declare outside an experimental
table: the exact KV index's per-block loops (router/kv/_kvindex.c; router/kv/index_ops.py selects
them at import and checks them against its Python twins). Everything else about the package is in
pyproject.toml.

Optional: where no C compiler works, `pip install` warns and goes on, and the index runs the same
loops in Python. `python setup.py build_ext --inplace` builds it beside its source (a checkout used
through PYTHONPATH); `pip install -e .` builds it for an editable install.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("router.kv._kvindex", ["router/kv/_kvindex.c"], optional=True)])
