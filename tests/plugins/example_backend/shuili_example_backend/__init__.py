"""Example out-of-tree shuili platform (see docs/adding-a-backend.md)."""
