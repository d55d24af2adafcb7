"""Speculative decoding that changes no output bit: drafters (one file each) behind `base.Drafter`,
the exact-match acceptance rule (`verify.py`) and the config (`config.py`). See docs/speculative.md."""
