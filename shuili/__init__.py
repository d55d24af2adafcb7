"""shuili: DeepSeek-V4 inference on a pluggable hardware abstraction layer.

The subpackages live in the repository's top-level folders (core/, hal/, platforms/, conformance/);
pyproject maps them into this namespace for installs. From a source checkout (editable install or
PYTHONPATH) the same mapping is made here by adding the repository root to this package's path.
"""
from __future__ import annotations

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "hal", "hookspecs.py")) and _root not in __path__:
    __path__.append(_root)

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: `import shuili` must stay cheap and must not import torch_npu or triton
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from shuili.core import api

        return getattr(api, name)
    raise AttributeError(f"module 'shuili' has no attribute {name!r}")
