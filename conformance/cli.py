"""`shuili conformance run` and `shuili conformance baseline update`."""
from __future__ import annotations

import shlex
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("conformance", help="check a platform against the reference, bit for bit")
    csub = p.add_subparsers(dest="conformance_command", metavar="ACTION")

    r = csub.add_parser("run", help="run the suite; writes DIR/report.json and DIR/report.md; "
                                    "exits 1 on any failure")
    r.add_argument("--platform", required=True, help="platform name (see `shuili platforms`)")
    r.add_argument("--workload", action="append", default=None, metavar="W",
                   help="engine workload (repeatable): tiny-v4, smollm2-135m; default tiny-v4")
    r.add_argument("--out", required=True, metavar="DIR", help="report directory")
    r.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh seed, recorded)")
    r.add_argument("--cases", type=int, default=3, help="fuzzed cases per op, dtype and format")
    r.add_argument("--op", action="append", default=None, metavar="OP", help="only these ops (repeatable)")
    r.add_argument("--no-engine", action="store_true", help="op-level checks only")
    r.add_argument("--batch-invariant", action="store_true",
                   help="judge the platform in its batch-invariant mode (platform.batch_invariant)")
    r.add_argument("--no-replay", action="store_true", help="skip the bounded-replay check")
    r.add_argument("--engine-check", action="append", default=None, metavar="CHECK",
                   help="only these engine checks (repeatable): run_to_run, prefix_cache, "
                        "batch_invariance, chunking, preemption, decode_vs_prefill, cross_platform, "
                        "negative_control")
    r.add_argument("--engine-level", default="batch_invariant", choices=["run_to_run", "batch_invariant"],
                   help="what the engine checks hold the platform to (default: batch_invariant, the "
                        "engine's promise; run_to_run reports batch-invariance divergence as info)")
    r.add_argument("--baselines", default=None, metavar="DIR", help="baseline root (default: the package's)")
    r.set_defaults(func=cmd_run)

    b = csub.add_parser("baseline", help="locked baselines")
    bsub = b.add_subparsers(dest="baseline_command", metavar="ACTION")
    u = bsub.add_parser("update", help="re-run workloads and lock them as baselines (cross-host lock, "
                                       "atomic write)")
    u.add_argument("--platform", required=True, help="platform name (see `shuili platforms`)")
    u.add_argument("--workload", action="append", default=None, metavar="W",
                   help="workload (repeatable); default tiny-v4")
    u.add_argument("--baselines", default=None, metavar="DIR", help="baseline root (default: the package's)")
    u.add_argument("--lock-timeout", type=float, default=300.0, help="seconds to wait for the lock")
    u.set_defaults(func=cmd_update)

    def usage(args) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)
    b.set_defaults(func=lambda args: (b.print_help(), 2)[1])


def _root(args) -> str:
    from shuili.conformance import baselines

    return args.baselines or baselines.DEFAULT_ROOT


def _check_names(args) -> None:
    from shuili.conformance import workloads
    from shuili.conformance.runner import ENGINE_CHECKS

    for w in args.workload or ():
        workloads.get(w)  # ValueError naming the known workloads
    bad = [c for c in getattr(args, "engine_check", None) or () if c not in ENGINE_CHECKS]
    if bad:
        raise ValueError(f"unknown engine checks {bad}; use {', '.join(ENGINE_CHECKS)}")


def cmd_run(args) -> int:
    from shuili.conformance import report as report_mod
    from shuili.conformance.runner import run_conformance

    _check_names(args)
    if args.cases < 1:
        raise ValueError(f"--cases {args.cases}: give at least 1")
    rep = run_conformance(
        args.platform, args.workload, seed=args.seed, cases=args.cases, ops=args.op,
        engine=not args.no_engine, engine_checks=tuple(args.engine_check) if args.engine_check else None,
        engine_level=args.engine_level, baseline_root=_root(args), replay=not args.no_replay,
        batch_invariant=args.batch_invariant,
        command="shuili " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    js, md = report_mod.write(rep, args.out)
    counts = rep.counts()
    print(f"conformance of {rep.platform}: {'PASSED' if rep.passed else 'FAILED'} "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())}); seed {rep.seed}")
    for c in rep.failures():
        line = f"  {c.status.upper()} {c.name}: {c.message}"
        if c.divergence is not None:
            line += f"\n      first divergence {c.divergence.line()}"
        print(line)
    print(f"report: {md} and {js}")
    return 0 if rep.passed else 1


def cmd_update(args) -> int:
    from shuili.conformance.runner import update_baselines

    _check_names(args)
    paths = update_baselines(args.platform, args.workload or ["tiny-v4"], _root(args), args.lock_timeout)
    for p in paths:
        print(f"locked {p}")
    return 0
