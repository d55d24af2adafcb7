"""DeepSeek-V4 against HF transformers (float32, CPU): one-shot prefill and chunked prefill + decode
through shuili's paged caches, on several seeds and prompt lengths that cross the 16-token window,
the CSA ratio 4 and the HCA ratio 16; batch/chunk invariance of the logits bits; the MTP block."""
from __future__ import annotations

import pytest
import torch

from shuili.core.models import deepseek_v4 as V
from shuili.core.models.deepseek_v4_config import named
from shuili.core.models.deepseek_v4_loader import random_params, released_tensors, save_checkpoint
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_and_ours(tmp_path_factory, ops, seed: int):
    """Random tiny-v4 weights -> a released-name checkpoint -> HF from_pretrained and shuili's loader."""
    cfg = named("tiny-v4")
    path = str(tmp_path_factory.mktemp(f"tiny{seed}"))
    save_checkpoint(path, cfg, released_tensors(cfg, random_params(cfg, seed=seed)), shards=2)
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    hf.eval()
    return hf, V.load_checkpoint(path, ops, progress=False)


@pytest.fixture(scope="module", params=[1, 2])
def pair(request, tmp_path_factory, ops):
    return request.param, *_hf_and_ours(tmp_path_factory, ops, request.param)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0]


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed))


def test_hf_sees_our_weights(pair):
    _, hf, m = pair
    # the loader produced what HF's own conversion of the released names produced
    assert torch.equal(hf.model.layers[2].self_attn.sinks.detach(), m.blocks[2].attn.sink)
    assert torch.equal(hf.model.layers[0].mlp.gate.tid2eid, m.blocks[0].ffn.tid2eid)
    e = hf.model.layers[3].mlp.experts.gate_up_proj.detach()
    assert torch.equal(e, m.blocks[3].ffn.w13.data)


def test_oneshot_prefill_matches_hf(pair):
    seed, hf, m = pair
    lens = (17, 70)  # 70: past 4 windows, 17 CSA entries, 4 HCA entries; 17: one HCA entry
    seqs = [_ids(seed * 10 + i, n) for i, n in enumerate(lens)]
    drv = m.driver(max_seqs=2, max_len=128)
    out = m.forward(drv.batch([(i, s.tolist()) for i, s in enumerate(seqs)], logits="all"))
    o = 0
    for s in seqs:
        assert _rel(out[o:o + len(s)], _hf_logits(hf, s)) <= TOL
        o += len(s)


def test_chunked_prefill_and_decode_match_hf(pair):
    seed, hf, m = pair
    prompts = {0: [21, 19, 30], 1: [7, 33, 13]} if seed == 1 else {0: [5, 50], 1: [18, 14, 2]}
    total = {s: sum(c) + 30 for s, c in prompts.items()}
    seqs = {s: _ids(seed * 100 + s, total[s]) for s in prompts}
    drv = m.driver(max_seqs=2, max_len=128)
    got = {s: [] for s in prompts}
    done = {s: 0 for s in prompts}
    steps = max(len(c) for c in prompts.values())
    plan = [[(s, c[k]) for s, c in prompts.items() if k < len(c)] for k in range(steps)]
    plan += [[(s, 1) for s in prompts]] * 30
    for step in plan:
        chunks = [(s, seqs[s][done[s]:done[s] + n].tolist()) for s, n in step]
        lg = m.forward(drv.batch(chunks, logits="all"))
        o = 0
        for s, n in step:
            got[s].append(lg[o:o + n])
            o += n
            done[s] += n
    for s in prompts:
        ref = _hf_logits(hf, seqs[s])
        out = torch.cat(got[s])
        assert out.shape == ref.shape
        assert _rel(out[-30:], ref[-30:]) <= TOL  # the decode steps
        assert _rel(out, ref) <= TOL


def test_logit_bits_do_not_depend_on_batch_or_chunking(ops):
    m = V.build("tiny-v4", ops, seed=3)
    a, b = _ids(5, 48).tolist(), _ids(6, 31).tolist()
    drv = m.driver(max_seqs=1, max_len=64)
    alone = m.forward(drv.batch([(0, a)], logits="all"))
    drv = m.driver(max_seqs=2, max_len=64)
    steps = [[(1, b[:13]), (0, a[:9])], [(0, a[9:45]), (1, b[13:29])], [(0, a[45:46])],
             [(1, b[29:30]), (0, a[46:47])], [(0, a[47:48]), (1, b[30:31])]]
    got = []
    for step in steps:
        lg = m.forward(drv.batch(step, logits="all"))
        o = 0
        for s, toks in step:
            if s == 0:
                got.append(lg[o:o + len(toks)])
            o += len(toks)
    assert torch.equal(alone, torch.cat(got))


def test_mtp_block_matches_hf_layer(ops, tmp_path):
    """mtp.0 = e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_t)), a window-only block, its own hc head."""
    cfg = named("tiny-v4")
    params = random_params(cfg, seed=7)
    m = V.DeepseekV4Model(cfg, ops, params, with_mtp=True)
    ids = _ids(8, 40)
    drv = m.driver(max_seqs=1, max_len=64)
    m.forward(drv.batch([(0, ids[:-1].tolist())], logits="all"), keep_hidden=True)
    hidden = m.last_hidden
    drv.lens[0] = 0  # the MTP layer has its own window slots; replay positions 0..38
    got = m.forward_mtp(drv.batch([(0, ids[1:].tolist())], logits="all"), hidden)
    assert got.shape == (39, cfg.vocab_size)

    # oracle: HF's decoder layer 1 (window-only, top-k MoE) carrying the mtp.0 block weights
    tensors = released_tensors(cfg, params)
    for k in list(tensors):
        if k.startswith("mtp.0.") and not k.split(".", 2)[2].startswith(("e_proj", "h_proj", "enorm", "hnorm",
                                                                           "norm", "hc_head")):
            tensors["layers.1." + k.split(".", 2)[2]] = tensors[k].clone()
    save_checkpoint(str(tmp_path), cfg, tensors)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    layer = hf.model.layers[1]
    f = {k: v.double() for k, v in params.items() if k.startswith("mtp.0.") and isinstance(v, torch.Tensor)}
    w = lambda n: params[n].data.double()  # noqa: E731

    def rms(x, wt, eps=cfg.rms_norm_eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 if wt is None else wt)

    e = rms(params["embed.weight"].double()[ids[1:]], f["mtp.0.enorm.weight"])
    h = rms(hidden.double(), f["mtp.0.hnorm.weight"])
    x = (e @ w("mtp.0.e_proj.weight").T)[:, None] + h @ w("mtp.0.h_proj.weight").T
    S, W = x.shape[0], cfg.sliding_window
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    mask = torch.where((j <= i) & (j > i - W), 0.0, float("-inf"))[None, None]
    pos = torch.arange(S)[None]
    xf = x.float()[None]
    pe = {"main": hf.model.rotary_emb(xf, pos, layer_type="main"),
          "compress": hf.model.rotary_emb(xf, pos, layer_type="compress")}
    with torch.no_grad():
        y = layer(xf, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                  input_ids=ids[1:][None], cache=None)[0].double()
    flat = rms(y.flatten(1), None)
    pre = torch.sigmoid(flat @ f["mtp.0.hc_head_fn"].T * f["mtp.0.hc_head_scale"] + f["mtp.0.hc_head_base"])
    y = ((pre + cfg.hc_eps)[..., None] * y).sum(1)
    ref = rms(y, f["mtp.0.norm.weight"]) @ w("head.weight").T
    assert _rel(got.double(), ref) <= TOL


def test_compressor_ape_row_adds_nothing_to_the_kv_half():
    """_comp_proj writes kv | gate + ape in one add of ape_row: its kv half is -0.0, which leaves every
    value's bits as they were (+0 and -0, inf, NaN, subnormals), and its gate half is ape."""
    ape = torch.randn(4, 6)
    c = V.Compressor(V.Weight.dense(torch.zeros(12, 8)), ape, torch.ones(3), dim=3, ratio=4, coff=2)
    assert c.ape_row.shape == (4, 12) and torch.equal(c.ape_row[:, 6:], ape)
    kv = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])
    got = (kv[None] + c.ape_row[:, :6]).view(torch.int32)
    assert torch.equal(got, kv.view(torch.int32)[None].expand(4, -1))
    # a +0.0 pad would not do: -0.0 + +0.0 is +0.0
    assert (torch.tensor(-0.0) + 0.0).view(torch.int32) != torch.tensor(-0.0).view(torch.int32)
