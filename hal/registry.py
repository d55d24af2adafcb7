"""Plugin discovery, the API-version handshake and platform selection.

Discovery: every entry point of the group `shuili.platforms` (the built-in platforms register the
same way, in pyproject; from a source checkout without metadata they are registered directly).
Selection: `resolve_platform(PlatformConfig)` returns a `ResolvedPlatform` holding a frozen
`DispatchTable`; nothing later calls pluggy.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass, field
from typing import Callable

import pluggy

from shuili.hal import hookspecs
from shuili.hal.capabilities import DeterminismLevel, OpCapability, PlatformCapabilities
from shuili.hal.config import PlatformConfig
from shuili.hal.ops import OP_NAMES, DispatchTable, check_signature, with_hints
from shuili.hal.transfer import HostTransfer, Transfer
from shuili.hal.types import Availability, PlatformInfo
from shuili.hal.version import HAL_API_MAJOR, HAL_API_VERSION

log = logging.getLogger("shuili.hal")

BUILTIN_PLATFORMS = {
    "reference": "shuili.platforms.reference.plugin",
    "nvidia": "shuili.platforms.nvidia.plugin",
    "ascend": "shuili.platforms.ascend.plugin",
}
REFERENCE = "reference"


class HALError(RuntimeError):
    """Base of every platform-selection error; the message says what to do."""


class PlatformUnavailableError(HALError):
    pass


class DuplicatePlatformError(HALError):
    pass


class IncompatiblePluginError(HALError):
    pass


class MissingOpError(HALError):
    pass


@dataclass(frozen=True)
class PlatformEntry:
    """One platform as discovered: its info, which plugin gave it, and whether it can be used."""

    name: str
    plugin: str  # entry-point / registration name of the plugin object
    info: PlatformInfo | None
    availability: Availability
    problem: str = ""  # refusal reason (version, duplicate, broken plugin); "" when fine

    @property
    def usable(self) -> bool:
        return not self.problem and self.availability.available


@dataclass
class Discovery:
    pm: pluggy.PluginManager
    entries: list[PlatformEntry]
    broken: dict[str, str] = field(default_factory=dict)  # plugin name -> why it was not loaded


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _register(pm: pluggy.PluginManager, plugin: object, name: str, broken: dict[str, str]) -> None:
    if pm.get_plugin(name) is not None or pm.is_registered(plugin):
        return
    try:
        pm.register(plugin, name=name)
        pm.check_pending()  # a hookimpl with no spec (a typo) is refused here, not ignored
    except (pluggy.PluginValidationError, ValueError) as exc:
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
        broken[name] = f"invalid plugin: {exc}"
        log.error("platform plugin %r refused: %s", name, exc)


def get_plugin_manager(
    allowlist: list[str] | None = None, extra_plugins: dict[str, object] | None = None
) -> Discovery:
    """Load every platform plugin (entry points, built-ins, `extra_plugins` for tests)."""
    pm = _new_manager()
    broken: dict[str, str] = {}
    wanted = None if allowlist is None else set(allowlist)
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        if wanted is not None and ep.name not in wanted:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken vendor package must not take down the others
            broken[ep.name] = f"import of {ep.value} failed: {type(exc).__name__}: {exc}"
            log.error("platform plugin %r failed to load: %s", ep.name, broken[ep.name])
            continue
        _register(pm, plugin, ep.name, broken)
    for name, module in BUILTIN_PLATFORMS.items():
        if (wanted is None or name in wanted) and pm.get_plugin(name) is None and name not in broken:
            _register(pm, importlib.import_module(module), name, broken)
    for name, plugin in (extra_plugins or {}).items():
        _register(pm, plugin, name, broken)
    return Discovery(pm, _collect(pm), broken)


def _version_problem(info: PlatformInfo) -> str:
    try:
        major = int(str(info.hal_api_version).split(".")[0])
    except ValueError:
        return f"declares an unreadable HAL API version {info.hal_api_version!r}"
    if major != HAL_API_MAJOR:
        return (
            f"built for HAL API {info.hal_api_version}, but this shuili implements "
            f"{HAL_API_VERSION}: install a plugin release for HAL {HAL_API_MAJOR}.x"
        )
    return ""


def _probe(pm: pluggy.PluginManager, name: str) -> Availability:
    try:
        result = pm.hook.shuili_platform_probe(platform=name)
    except Exception as exc:
        return Availability.no(f"probe raised {type(exc).__name__}: {exc}")
    if result is None:
        return Availability.no("the plugin registered this platform but its probe returned nothing")
    return result


def _collect(pm: pluggy.PluginManager) -> list[PlatformEntry]:
    raw: list[tuple[str, PlatformInfo]] = []
    for impl in pm.hook.shuili_platform_info.get_hookimpls():
        try:
            info = impl.function()
        except Exception as exc:
            raw.append((impl.plugin_name, None))  # type: ignore[arg-type]
            log.error("platform_info of %r raised: %s", impl.plugin_name, exc)
            continue
        if info is not None:
            raw.append((impl.plugin_name, PlatformInfo.model_validate(info)))
    claims: dict[str, list[str]] = {}
    for plugin, info in raw:
        if info is not None:
            claims.setdefault(info.name, []).append(plugin)
    entries = []
    for plugin, info in sorted(raw, key=lambda r: r[0]):
        if info is None:
            entries.append(PlatformEntry(plugin, plugin, None, Availability.no("platform_info raised"),
                                         "the plugin's shuili_platform_info hook raised"))
            continue
        problem = _version_problem(info)
        if len(claims[info.name]) > 1:
            problem = (f"platform name {info.name!r} is claimed by plugins "
                       f"{sorted(claims[info.name])}: uninstall one, or load one with `plugins:`")
        avail = Availability.no(problem) if problem else _probe(pm, info.name)
        entries.append(PlatformEntry(info.name, plugin, info, avail, problem))
    return entries


def list_platforms(allowlist: list[str] | None = None, extra_plugins: dict | None = None) -> Discovery:
    return get_plugin_manager(allowlist, extra_plugins)


@dataclass(frozen=True)
class ResolvedPlatform:
    """The outcome of selection: everything the engine needs, no pluggy inside."""

    info: PlatformInfo
    capabilities: PlatformCapabilities
    ops: DispatchTable
    config: PlatformConfig
    reason: str  # why this platform was chosen
    fallbacks: tuple[str, ...] = ()
    # capture(fn) -> replay, from the optional shuili_platform_graph_capture hook; None = run eagerly
    capture_graph: Callable | None = None
    # host <-> device copies, from the optional shuili_platform_transfer hook
    transfer: Transfer = field(default_factory=HostTransfer)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def device(self) -> str:
        return self.config.device or self.capabilities.device_type


def _explain(entries: list[PlatformEntry], broken: dict[str, str]) -> str:
    lines = [f"  - {e.name} (plugin {e.plugin}): "
             + ("available" if e.usable else (e.problem or e.availability.reason)) for e in entries]
    lines += [f"  - plugin {n}: not loaded: {why}" for n, why in sorted(broken.items())]
    return "\n".join(lines) or "  (no platform plugins found: is shuili installed?)"


def _choose(config: PlatformConfig, disc: Discovery) -> tuple[PlatformEntry, str]:
    entries = disc.entries
    clashes = sorted({e.problem for e in entries if "claimed by plugins" in e.problem})
    if clashes and (config.platform == "auto" or any(e.name == config.platform for e in entries
                                                      if e.problem in clashes)):
        raise DuplicatePlatformError("; ".join(clashes))
    if config.platform == "auto":
        usable = [e for e in entries if e.usable]
        if not usable:
            raise PlatformUnavailableError("no platform is available:\n" + _explain(entries, disc.broken))
        usable.sort(key=lambda e: (-e.info.priority, e.name))
        top = usable[0]
        if len(usable) > 1 and usable[1].info.priority == top.info.priority:
            raise DuplicatePlatformError(
                f"platform: auto is ambiguous: {top.name} and {usable[1].name} are available with "
                f"the same priority {top.info.priority}; name one in the config")
        skipped = ", ".join(f"{e.name} ({e.availability.reason or e.problem})"
                            for e in entries if not e.usable)
        reason = (f"auto: {top.name} has the highest priority ({top.info.priority}) of the available "
                  f"platforms {[e.name for e in usable]}" + (f"; unavailable: {skipped}" if skipped else ""))
        return top, reason
    matches = [e for e in entries if e.name == config.platform]
    if not matches:
        raise PlatformUnavailableError(
            f"unknown platform {config.platform!r}. Installed platforms:\n"
            + _explain(entries, disc.broken)
            + "\nUse one of these names or 'auto', or install the vendor's plugin package.")
    entry = matches[0]
    if entry.problem:
        cls = DuplicatePlatformError if "claimed by plugins" in entry.problem else IncompatiblePluginError
        raise cls(f"platform {entry.name!r} refused: {entry.problem}")
    if not entry.availability.available:
        raise PlatformUnavailableError(
            f"platform {entry.name!r} is not available: {entry.availability.reason}\n"
            "All platforms:\n" + _explain(entries, disc.broken))
    return entry, f"explicit: platform {entry.name!r} from config"


def _reference_ops(pm: pluggy.PluginManager, config: PlatformConfig):
    ops = pm.hook.shuili_platform_ops(platform=REFERENCE, config=config)
    caps = pm.hook.shuili_platform_capabilities(platform=REFERENCE, config=config)
    if ops is None or caps is None:
        raise MissingOpError("the reference platform is needed for fallback ops but is not loaded")
    return ops, caps


def resolve_platform(
    config: PlatformConfig | None = None, extra_plugins: dict | None = None
) -> ResolvedPlatform:
    config = config or PlatformConfig()
    allow = None if config.plugins is None else sorted(set(config.plugins) | {REFERENCE})
    disc = get_plugin_manager(allow, extra_plugins)
    entry, reason = _choose(config, disc)
    pm = disc.pm
    ops = dict(pm.hook.shuili_platform_ops(platform=entry.name, config=config) or {})
    caps = pm.hook.shuili_platform_capabilities(platform=entry.name, config=config)
    if caps is None:
        raise HALError(f"platform {entry.name!r} declares no capabilities (shuili_platform_capabilities)")
    caps = PlatformCapabilities.model_validate(caps)
    unknown = sorted(set(ops) - set(OP_NAMES))
    if unknown:
        raise HALError(f"platform {entry.name!r} provides ops not in HAL {HAL_API_VERSION}: {unknown}")
    for name, fn in ops.items():
        problem = check_signature(name, fn)
        if problem:
            raise HALError(f"platform {entry.name!r}: {problem}")
    missing = [n for n in OP_NAMES if n not in ops]
    sources = {n: entry.name for n in ops}
    cap_ops = dict(caps.ops)
    undeclared_missing = [n for n in missing if n not in caps.fallback_ops]
    if undeclared_missing or (missing and entry.name == REFERENCE):
        raise MissingOpError(
            f"platform {entry.name!r} does not implement ops {undeclared_missing or missing} and does "
            "not declare them as reference fallbacks (capabilities.fallback_ops). Use a platform "
            "that has them, or ask the platform's vendor for a release that implements them.")
    if missing and not config.allow_reference_fallback:
        raise MissingOpError(
            f"platform {entry.name!r} leaves ops {missing} to the reference implementation, and the "
            "config forbids fallbacks (allow_reference_fallback: false). Allow them, or use a "
            "platform that implements every op.")
    if missing:
        ref_ops, ref_caps = _reference_ops(pm, config)
        for name in missing:
            ops[name] = ref_ops[name]
            sources[name] = REFERENCE
            ref_cap = ref_caps.ops.get(name, OpCapability())
            # the same code on the same CPU is the reference; on another device only its
            # row-wise structure (batch invariance) carries over, not the bits
            level = ref_cap.determinism if caps.device_type == "cpu" else min(
                ref_cap.determinism, DeterminismLevel.batch_invariant)
            cap_ops[name] = ref_cap.model_copy(update={
                "determinism": level, "notes": f"reference fallback on {entry.name}"})
        log.warning("platform %s: ops %s run on the reference implementation (declared fallbacks)",
                    entry.name, missing)
    undeclared = [n for n in OP_NAMES if n not in cap_ops]
    if undeclared:
        raise HALError(f"platform {entry.name!r} declares no capability for ops {undeclared}")
    caps = caps.model_copy(update={"ops": cap_ops})
    ops = {name: with_hints(name, fn) for name, fn in ops.items()}
    capture = _graph_capture(pm, entry.name, config, caps)
    transfer = pm.hook.shuili_platform_transfer(platform=entry.name, config=config) or HostTransfer()
    log.info("platform %s selected (%s)", entry.name, reason)
    return ResolvedPlatform(entry.info, caps, DispatchTable(entry.name, ops, sources), config, reason,
                            tuple(missing), capture, transfer)


def _graph_capture(pm: pluggy.PluginManager, name: str, config: PlatformConfig,
                   caps: PlatformCapabilities) -> Callable | None:
    capture = pm.hook.shuili_platform_graph_capture(platform=name, config=config)
    if capture is None:
        return None
    if not caps.graph_capture:
        raise HALError(f"platform {name!r} returns a graph capture but declares graph_capture=False; "
                       "declare it in capabilities or return None from shuili_platform_graph_capture")
    if not callable(capture):
        raise HALError(f"platform {name!r}: shuili_platform_graph_capture returned "
                       f"{type(capture).__name__}, not a callable capture(fn) -> replay")
    return capture
