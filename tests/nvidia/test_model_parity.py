"""tiny-v4 on the nvidia op table (batch-invariant mode, and default mode on prefill's dense path)
against the same model on the reference ops: teacher-forced logprobs within the engine's
cross_platform tolerance. The nvidia model is built on the test device and the reference one on the
CPU, as the conformance check builds them."""
import torch

from shuili.conformance.engine_check import MODEL_TOLERANCE
from shuili.conformance.workloads import get
from shuili.core.models.deepseek_v4 import build
from shuili.hal.ops import OP_NAMES, DispatchTable
from shuili.platforms.nvidia import attention, gemm, indexer, qgemm, sparse_group
from shuili.platforms.nvidia.ops import make_ops
from shuili.platforms.reference.ops import OPS as REF


def _logprobs(ops, device, text):
    m = build("tiny-v4", ops, device=device, dtype="float32", seed=0)
    ids = m.tokenizer.encode(text)
    drv = m.driver(max_seqs=1, max_len=64)
    logits = m.forward(drv.batch([(0, ids)], logits="all")).double().cpu()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _check(device, batch_invariant: bool):
    # 34 tokens: past the 16-token window, several CSA entries and two HCA entries
    text = get("tiny-v4").prompts[2]
    nv = DispatchTable("nvidia", make_ops(batch_invariant=batch_invariant),
                       {n: "nvidia" for n in OP_NAMES})
    ref = DispatchTable("reference", dict(REF), {n: "reference" for n in OP_NAMES})
    got, want = _logprobs(nv, device, text), _logprobs(ref, "cpu", text)
    tol = MODEL_TOLERANCE["atol"] + MODEL_TOLERANCE["rtol"] * want.abs()
    bad = ((got - want).abs() > tol).nonzero()
    assert bad.numel() == 0, (f"position {int(bad[0]) + 1}: {float(got[bad[0]]):.6f} vs reference "
                              f"{float(want[bad[0]]):.6f}")


def test_tiny_v4_matches_the_reference_model(device):
    _check(device, batch_invariant=True)


def test_tiny_v4_prefill_path_matches_the_reference_model(device, monkeypatch):
    """Default mode with the many-rows thresholds at one row: the MoE runs qgemm's pipeline on the
    dense experts (prefill's path, dequant.py) inside a whole forward, within the same tolerance."""
    seen, launch = [], qgemm._launch
    monkeypatch.setattr(qgemm, "_launch",
                        lambda x, w, *a, **kw: seen.append(w.format) or launch(x, w, *a, **kw))
    monkeypatch.setattr(gemm, "DENSE_MOE_MIN_ROWS", 1)
    monkeypatch.setattr(gemm, "DENSE_MIN_ROWS", 1)
    _check(device, batch_invariant=False)
    assert seen and set(seen) == {"dense"}


def test_tiny_v4_grouped_prefill_paths_match_the_reference_model(device, monkeypatch):
    """Default mode with the opt-in prefill paths on at one token (float32 let in: the interpreter has
    no bf16): sparse attention over four neighbouring tokens a program (sparse_group) and the
    indexer's score over four tokens of one sequence, inside a whole forward (the window's paged
    slots, the CSA top-k's and HCA's entries), within the same tolerance."""
    monkeypatch.setattr(attention, "DIRECT_WAVES", 0)
    monkeypatch.setattr(sparse_group, "MIN_TOKENS", 1)
    monkeypatch.setattr(sparse_group, "DTYPES", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(indexer, "GROUP_MIN_TOKENS", 1)
    groups, run = [], sparse_group.sparse_attention
    monkeypatch.setattr(sparse_group, "sparse_attention", lambda *a: groups.append(len(a[1])) or run(*a))
    toks, kernel = [], indexer._score_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: toks.append(kw["TOK"]) or kernel[grid](*a, **kw)

    monkeypatch.setattr(indexer, "_score_kernel", Spy())
    _check(device, batch_invariant=False)
    assert set(groups) == {1, 2} and set(toks) == {indexer.GROUP_TOKENS}
