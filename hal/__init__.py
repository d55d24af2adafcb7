"""The hardware abstraction layer: hook specs, capabilities, the op contract and platform selection.

pluggy is used for discovery only. `resolve_platform()` turns the chosen plugin into a frozen
`DispatchTable` of plain callables; hot paths call those, never `pm.hook`.
"""
from shuili.hal.version import HAL_API_VERSION, HAL_API_MAJOR
from shuili.hal.capabilities import (
    DeterminismLevel,
    DtypeSupport,
    OpCapability,
    PlatformCapabilities,
    Support,
)
from shuili.hal.types import Availability, PlatformInfo, Weight
from shuili.hal.ops import OP_SPECS, OpSpec, DispatchTable
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import (
    HALError,
    PlatformUnavailableError,
    DuplicatePlatformError,
    IncompatiblePluginError,
    MissingOpError,
    ResolvedPlatform,
    get_plugin_manager,
    list_platforms,
    resolve_platform,
)

__all__ = [
    "HAL_API_VERSION", "HAL_API_MAJOR", "DeterminismLevel", "DtypeSupport", "OpCapability",
    "PlatformCapabilities", "Support", "Availability", "PlatformInfo", "Weight", "OP_SPECS", "OpSpec",
    "DispatchTable", "PlatformConfig", "HALError", "PlatformUnavailableError", "DuplicatePlatformError",
    "IncompatiblePluginError", "MissingOpError", "ResolvedPlatform", "get_plugin_manager",
    "list_platforms", "resolve_platform",
]
