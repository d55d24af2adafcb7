"""The model tests' shared helpers live in models_helpers.py (imported by name: this folder is put on
sys.path, as tests/core does for core_helpers)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
