"""NVIDIA platform: torch + Triton kernels; SM100 paths by capability detection, SM90 fallback."""
