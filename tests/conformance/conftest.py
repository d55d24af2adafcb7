"""One torch thread for these tests: on a shared 2-core host torch's two OpenMP threads spin
against each other (3.5 min vs 33 s for this folder, measured); the reference's bits do not
depend on the thread count (docs/conformance.md, Baselines)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the CLI subprocesses
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

