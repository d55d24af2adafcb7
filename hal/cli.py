"""`shuili platforms`: every installed platform with availability, reason, HAL version, capabilities."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("platforms", help="list platforms, their availability and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def describe() -> dict:
    from shuili.hal import PlatformConfig
    from shuili.hal.registry import list_platforms
    from shuili.hal.version import HAL_API_VERSION

    disc = list_platforms()
    rows = []
    for e in disc.entries:
        row = {
            "name": e.name,
            "plugin": e.plugin,
            "vendor": e.info.vendor if e.info else None,
            "priority": e.info.priority if e.info else None,
            "hal_api_version": e.info.hal_api_version if e.info else None,
            "available": e.usable,
            "reason": e.problem or e.availability.reason,
            "capabilities": None,
        }
        if not e.problem:
            try:
                caps = disc.pm.hook.shuili_platform_capabilities(platform=e.name, config=PlatformConfig())
                row["capabilities"] = caps.summary() if caps is not None else None
            except Exception as exc:  # a broken capability hook is reported, not fatal
                row["capabilities"] = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
    return {"hal_api_version": HAL_API_VERSION, "platforms": rows,
            "broken_plugins": [{"plugin": n, "reason": r} for n, r in sorted(disc.broken.items())]}


def run(args) -> int:
    data = describe()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"shuili HAL API {data['hal_api_version']}")
    for r in data["platforms"]:
        mark = "available  " if r["available"] else "unavailable"
        caps = r["capabilities"] or {}
        det = ", ".join(f"{k}:{v}" for k, v in (caps.get("determinism") or {}).items())
        print(f"  {r['name']:<12} {mark}  HAL {r['hal_api_version']}  prio {r['priority']}  "
              f"ops {caps.get('ops', '-')}  [{det}]")
        print(f"  {'':<12} {r['reason']}")
    for b in data["broken_plugins"]:
        print(f"  plugin {b['plugin']}: NOT LOADED: {b['reason']}")
    return 0
