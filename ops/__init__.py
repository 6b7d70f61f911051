"""Not Python: the C/C++/CUDA sources of fastkv's ops (fastkv/ops.py builds them).

Python imports this file only when it was started in the directory above a checkout named
``fastkv``: it then takes the checkout's root for the package ``fastkv`` (a namespace package,
since the root has no ``__init__.py``) and this folder for ``fastkv.ops``. Say so in one line
instead of failing later on an attribute this folder does not have.
"""
from pathlib import Path as _Path

_root = _Path(__file__).absolute().parent.parent  # as Python found it (a link stays a link)
raise ImportError(
    f"fastkv: Python took the source checkout {_root} for the package (it was started in {_root.parent}, "
    f"the directory above a checkout named 'fastkv'); start it from another directory, or put "
    f"{_root} on PYTHONPATH"
)
