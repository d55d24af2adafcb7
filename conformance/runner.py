"""One conformance run: op checks, negative control, engine checks, bounded replay, baselines."""
from __future__ import annotations

import logging
import secrets
import time

from shuili.conformance import baselines, ops_check, workloads
from shuili.conformance.report import CheckResult, Report
from shuili.hal import PlatformConfig, resolve_platform

log = logging.getLogger("shuili.conformance")

ENGINE_CHECKS = ("run_to_run", "prefix_cache", "batch_invariance", "chunking", "preemption",
                 "decode_vs_prefill", "cross_platform", "negative_control")


def new_seed() -> int:
    return secrets.randbits(31)


def run_conformance(platform: str, workload_names: list[str] | None = None, seed: int | None = None,
                    cases: int = 3, ops: list[str] | None = None, engine: bool = True,
                    engine_checks: tuple[str, ...] | None = None, engine_level: str = "batch_invariant",
                    baseline_root: str = baselines.DEFAULT_ROOT, replay: bool = True,
                    command: str = "", extra_plugins: dict | None = None,
                    batch_invariant: bool = False) -> Report:
    """Everything `shuili conformance run` does, as a library call; returns the report."""
    seed = new_seed() if seed is None else seed
    t0 = time.perf_counter()
    # batch_invariant: judge the platform in its batch-invariant mode (PlatformConfig.batch_invariant)
    resolved = resolve_platform(PlatformConfig(platform=platform, batch_invariant=batch_invariant),
                                extra_plugins=extra_plugins)
    reference = resolve_platform(PlatformConfig(platform="reference"))
    report = Report(platform=resolved.name, seed=seed, command=command,
                    fingerprint=baselines.stack_fingerprint(resolved),
                    capabilities={"summary": resolved.capabilities.summary(),
                                  "ops": {n: c.determinism.name for n, c in resolved.capabilities.ops.items()},
                                  "sources": dict(resolved.ops.sources)})
    log.info("conformance of %s, seed %d", resolved.name, seed)
    # one line a stage (`shuili -v`): a run cut by a timeout still says how far it got
    _stage(report, "op checks", t0, ops_check.check_ops(resolved, reference, seed, cases, ops))
    _stage(report, "negative control", t0, ops_check.negative_control(reference, seed))
    names = list(workload_names) if workload_names is not None else list(workloads.DEFAULT_WORKLOADS)
    if engine:
        for name in names:
            _stage(report, f"engine workload {name}", t0, _engine(resolved.name, workloads.get(name), seed,
                                                                  engine_checks, engine_level, baseline_root,
                                                                  replay, batch_invariant))
    report.duration_s = time.perf_counter() - t0
    return report


def _stage(report: Report, what: str, t0: float, results: list[CheckResult]) -> None:
    report.add(results)
    bad = sum(r.status in ("fail", "error") for r in results)
    log.info("%s: %d checks, %d failed, at %.1f s", what, len(results), bad, time.perf_counter() - t0)


def _engine(platform: str, w: workloads.Workload, seed: int, checks, engine_level: str, root: str,
            replay: bool, batch_invariant: bool = False) -> list[CheckResult]:
    from shuili.conformance import engine_check

    try:
        results, er = engine_check.check_workload(w, platform, seed, engine_level, checks,
                                                  batch_invariant=batch_invariant)
    except Exception as exc:  # a platform crash inside the engine is a failure with its reason
        log.exception("engine checks of %s crashed", w.name)
        return [CheckResult(name=f"engine.{w.name}", kind="engine", status="fail",
                            message=f"the engine raised {type(exc).__name__}: {exc}")]
    if er.anchor and not any(s.error for s in er.anchor):
        resolved = resolve_platform(PlatformConfig(platform=platform, batch_invariant=batch_invariant))
        current = engine_check.baseline_body(w, platform, er, engine_check.text_samples(w, platform, batch_invariant))
        results.append(baselines.compare(baselines.load(root, platform, w.name), current,
                                         baselines.stack_fingerprint(resolved), f"baseline.{w.name}", root,
                                         baselines.op_levels(resolved)))
    if replay and w.bounded_replay:
        from shuili.conformance import replay as replay_mod

        try:
            results += replay_mod.check_bounded_replay(w, platform, seed, batch_invariant)
        except Exception as exc:
            log.exception("bounded replay of %s crashed", w.name)
            results.append(CheckResult(name=f"replay.{w.name}", kind="replay", status="fail",
                                       message=f"raised {type(exc).__name__}: {exc}"))
    if replay and w.cache_once:
        from shuili.conformance import cache_once

        try:
            results += cache_once.check_cache_once(w, platform, seed, batch_invariant)
        except Exception as exc:
            log.exception("cache-once check of %s crashed", w.name)
            results.append(CheckResult(name=f"cache_once.{w.name}", kind="replay", status="fail",
                                       message=f"raised {type(exc).__name__}: {exc}"))
    return results


def update_baselines(platform: str, workload_names: list[str], root: str = baselines.DEFAULT_ROOT,
                     timeout: float = 300.0) -> list[str]:
    """Run each workload's anchor batch on `platform` and lock it as the baseline."""
    from shuili.conformance import engine_check

    resolved = resolve_platform(PlatformConfig(platform=platform))
    paths = []
    for name in workload_names:
        w = workloads.get(name)
        sess = engine_check.Session(w, resolved.name)
        llm = sess.llm(enable_prefix_caching=True)
        reqs = sess.requests(llm.tokenizer)
        anchor = engine_check.run(llm, reqs)
        failed = [(r.label, s.error) for r, s in zip(reqs, anchor) if s.error]
        if failed:
            raise RuntimeError(f"workload {name} on {platform}: requests failed {failed[:3]}; "
                               "no baseline written")
        del llm
        body = engine_check.baseline_body(w, resolved.name, engine_check.EngineRun(anchor, reqs),
                                          engine_check.text_samples(w, resolved.name))
        settings = {"max_num_seqs": w.max_num_seqs, "enable_prefix_caching": True,
                    "max_tokens": w.max_tokens, "model": w.model}
        data = baselines.build(resolved.name, w.name, {m: v["samples"] for m, v in body["modes"].items()},
                               baselines.provenance(resolved, settings))
        paths.append(baselines.update(root, data, timeout=timeout))
    return paths
