"""Split-K's ordered sum done by each tile's last program (platforms/nvidia/splitk.py): the same bits
as the standalone sum kernel, for every GEMM that splits K, and the arrival counters left at zero,
so the next launch (or a graph replay) starts clean (GPU, or TRITON_INTERPRET on CPU)."""
import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.nvidia import gemm, qgemm, skinny, splitk

from test_kernels import on, rnd, weight


CASES = {
    # fp8 qgemm, default mode: 72 columns are 2 tiles, so K = 640 splits in 5 (MIN_KC 128)
    "qgemm": (lambda: (weight("fp8_block128", (72, 640), seed=40), 640), False),
    # the BI dense tile: float32, 72 columns (past the skinny kernel), K split from the weight's shape
    "gemm-bi": (lambda: (Weight.dense(rnd(72, 1024, seed=41)), 1024), True),
    # float32, few columns: the skinny kernel, 8 chunks
    "skinny": (lambda: (Weight.dense(rnd(24, 1024, seed=42)), 1024), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_split_sum_matches_the_sum_kernel(device, case, monkeypatch):
    monkeypatch.setattr(gemm, "USE_QGEMM", True)
    monkeypatch.setattr(qgemm, "MIN_KC", 128)
    monkeypatch.setattr(gemm, "BI_MIN_KC", 128)
    make, bi = CASES[case]
    w, k = make()
    w = on(w, device, torch.float32) if w.format != "dense" else w.to(device)
    x, bias = rnd(37, k, seed=43).to(device), rnd(w.shape[0], seed=44).to(device)

    launches = []
    real = splitk.split_sum
    monkeypatch.setattr(splitk, "split_sum", lambda *a: launches.append(1) or real(*a))
    fused = gemm.linear(x, w, bias, batch_invariant=bi)
    again = gemm.linear(x, w, bias, batch_invariant=bi)
    assert not launches, "the fused path ran the standalone sum"
    assert not splitk._BUFFERS[torch.device(device)].any()

    monkeypatch.setattr(splitk, "counters", lambda *a: None)
    plain = gemm.linear(x, w, bias, batch_invariant=bi)
    assert launches, f"{case}: K was not split, so the test checks nothing"
    assert torch.equal(fused, plain) and torch.equal(again, plain)


def test_counters_refuse_too_many_tiles_and_a_first_use_in_capture(device, monkeypatch):
    dev = torch.device(device)
    assert splitk.counters(dev, splitk.COUNTERS + 1) is None
    monkeypatch.setattr(splitk, "_BUFFERS", {})
    monkeypatch.setattr(splitk, "capturing", lambda: True)
    assert splitk.counters(dev, 4) is None and not splitk._BUFFERS
    monkeypatch.setattr(splitk, "capturing", lambda: False)
    buf = splitk.counters(dev, 4)
    assert buf is not None and buf.dtype == torch.int32 and not buf.any()
    monkeypatch.setattr(splitk, "capturing", lambda: True)
    assert splitk.counters(dev, 4) is buf  # allocated before the capture: used inside it


def test_skinny_linear_with_the_standalone_sum(device, monkeypatch):
    """The unfused path still sums: against the fused one, bit for bit."""
    x, w = rnd(5, 2048, seed=45).to(device), rnd(32, 2048, seed=46).to(device)
    y1 = skinny.linear(x, w, None, torch.empty(5, 32, device=device))
    monkeypatch.setattr(splitk, "counters", lambda *a: None)
    y2 = skinny.linear(x, w, None, torch.empty(5, 32, device=device))
    assert torch.equal(y1, y2)
