"""The conformance suite: is a platform's answer the reference's answer, bit for bit?

Library: `fuzz` (op input generators), `compare` (bitwise / tolerance comparators), `ops_check`
(op-level checks), `workloads` and `engine_check` (engine-level checks), `replay` (bounded-replay
check of the sliding window), `baselines` and `lock` (locked per-platform baselines), `report`
(report.json / report.md), `runner` (one full run), `cli` (`shuili conformance ...`) and
`pytest_plugin` (the same checks as pytest items). See docs/conformance.md.
"""
