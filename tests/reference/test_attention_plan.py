"""paged_attention reuses its index plan while the block tables, lengths and query layout are
equal in value to an earlier call's (every layer of a step); a change to any of them, in place or
in a new tensor, must give the freshly planned answer. The compiled form caches its checked int64
block tables and lengths the same way; both forms are run."""
import pytest
import torch

from shuili.platforms.reference import attention


def _setup(gen, lens, q_lens, bs=4, h=6, kvh=2, d=8):
    width = max(-(-n // bs) for n in lens) + 1
    blocks = len(lens) * width
    kc = torch.rand(blocks, bs, kvh, d, generator=gen) - 0.5
    vc = torch.rand(blocks, bs, kvh, d, generator=gen) - 0.5
    perm = torch.randperm(blocks, generator=gen)
    table = perm[:len(lens) * width].reshape(len(lens), width).to(torch.int32)
    q = torch.rand(sum(q_lens), h, d, generator=gen) - 0.5
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), qsl


_FORMS = [attention.paged_attention, attention.paged_attention_torch]


def _fresh(*args, form=attention.paged_attention_torch, **kw):
    attention._PLANS.clear()
    attention._NATIVE_ARGS.clear()
    return form(*args, **kw)


def _bits(x):
    return x.view(torch.int32)


def test_plan_is_shared_by_equal_inputs(gen):
    q, kc, vc, table, lens, qsl = _setup(gen, [9, 5, 12], [1, 1, 1])
    attention._PLANS.clear()
    a = attention._plan(table, lens, qsl, 3, 6, 2, 4, 0)
    b = attention._plan(table.clone(), lens.clone(), qsl.clone(), 3, 6, 2, 4, 0)
    assert a is b
    c = attention._plan(table, lens, qsl, 3, 6, 2, 4, 5)  # another window: its own plan
    assert c is not a


@pytest.mark.parametrize("form", _FORMS)
def test_changed_tables_and_lengths_are_replanned(gen, form):
    for q_lens, window in (([1, 1, 1], 0), ([1, 1, 1], 3), ([3, 1, 2], 0), ([3, 1, 2], 3)):
        q, kc, vc, table, lens, qsl = _setup(gen, [9, 5, 12], q_lens)
        first = form(q, kc, vc, table, lens, qsl, 0.5, window)
        assert torch.equal(_bits(first), _bits(_fresh(q, kc, vc, table, lens, qsl, 0.5, window)))
        form(q, kc, vc, table, lens, qsl, 0.5, window)  # the plan is cached
        table[0] = table[0].roll(1)  # in place: sequence 0 now reads other blocks
        moved = form(q, kc, vc, table, lens, qsl, 0.5, window)
        assert not torch.equal(moved[:q_lens[0]], first[:q_lens[0]])  # the change matters
        assert torch.equal(_bits(moved), _bits(_fresh(q, kc, vc, table, lens, qsl, 0.5, window)))
        form(q, kc, vc, table, lens, qsl, 0.5, window)
        lens[2] -= 1  # in place: one key fewer
        shorter = form(q, kc, vc, table, lens, qsl, 0.5, window)
        assert torch.equal(_bits(shorter), _bits(_fresh(q, kc, vc, table, lens, qsl, 0.5, window)))


@pytest.mark.parametrize("form", _FORMS)
def test_decode_rows_equal_one_sequence_calls(gen, form):
    q, kc, vc, table, lens, qsl = _setup(gen, [9, 5, 12, 1], [1, 1, 1, 1])
    both = form(q, kc, vc, table, lens, qsl, 0.5, 3)
    for b in range(4):
        one = _fresh(q[b:b + 1], kc, vc, table[b:b + 1], lens[b:b + 1],
                     torch.tensor([0, 1], dtype=torch.int32), 0.5, 3, form=form)
        assert torch.equal(_bits(one[0]), _bits(both[b]))
