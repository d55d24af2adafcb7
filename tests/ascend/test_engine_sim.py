"""The whole DeepSeek-V4 (tiny-v4) model through the engine on the Ascend backend over the
simulator: same greedy tokens as the reference platform, logprobs within float32 noise.

The engine resolves platforms by name, so `ascend-sim` is made discoverable for this test by a
throw-away entry point (a dist-info folder prepended to sys.path)."""
from __future__ import annotations

import pytest

api = pytest.importorskip("shuili.core.api")


@pytest.fixture
def ascend_sim_entry_point(tmp_path, monkeypatch):
    info = tmp_path / "shuili_ascend_sim-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shuili-ascend-sim\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[shuili.platforms]\nascend-sim = shuili.platforms.ascend.sim_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.slow
def test_tiny_v4_generates_like_the_reference(ascend_sim_entry_point, paths):
    params = api.SamplingParams(max_tokens=6, temperature=0.0)
    runs = {}
    for platform in ("reference", "ascend-sim"):
        llm = api.LLM(model="tiny-v4", platform=platform, max_num_seqs=2)
        runs[platform] = llm.generate(["Water flows"], params)[0]
    ref, npu = runs["reference"], runs["ascend-sim"]
    assert npu.token_ids == ref.token_ids and len(npu.token_ids) == 6
    assert max(abs(a - b) for a, b in zip(ref.logprobs, npu.logprobs)) < 1e-4
    # the NPU operators, not only host fallbacks, carried the model
    for path in ("rms_norm:npu_rms_norm", "rope:npu_rotary_mul", "grouped:npu_grouped_matmul",
                 "moe_experts:npu_moe_init_routing_v2"):
        assert paths[path] > 0, path
