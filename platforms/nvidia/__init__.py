"""NVIDIA platform: torch + Triton kernels. Measured on SM90; FP4 codes are decoded in registers on every SM
(no SM100-only path: see docs/platforms/nvidia.md)."""
