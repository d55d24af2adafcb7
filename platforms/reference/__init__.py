"""The CPU reference platform: pure torch, fixed-order float32 numerics, the conformance oracle."""
