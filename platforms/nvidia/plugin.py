"""NVIDIA platform plugin (kernels land in this package; see docs/platforms/nvidia.md)."""
from __future__ import annotations

from shuili.hal import HAL_API_VERSION, Availability, PlatformInfo
from shuili.hal.hookspecs import hookimpl

NAME = "nvidia"


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="NVIDIA", priority=100, hal_api_version=HAL_API_VERSION,
                        description="CUDA GPUs via torch + Triton (SM100; SM90 fallback)")


def probe() -> Availability:
    import torch

    if not torch.cuda.is_available():
        build = "CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return Availability.no(f"no CUDA device visible (torch {torch.__version__}, {build})")
    try:
        import triton  # noqa: F401
    except ImportError:
        return Availability.no("triton is not installed: pip install 'shuili[nvidia]'")
    major, minor = torch.cuda.get_device_capability()
    return Availability.yes(f"{torch.cuda.get_device_name()} (sm{major}{minor})", sm=major * 10 + minor)


@hookimpl
def shuili_platform_probe(platform):
    return probe() if platform == NAME else None
