"""shuili's reference platform against transformers on the same SmolLM2 GGUF, same run, same prompts.

Greedy decoding of a batch of prompts, every request generating exactly --output-len tokens (EOS
ignored on both sides), float32 weights on both sides (transformers dequantizes the GGUF to
float32; shuili's reference computes in float32 from the dequantized weights). Reports load time,
wall time and generated tokens per second for each, and the ratio. Both use the same torch thread
count (--threads, default: torch's default).

    python benchmarks/cpu_vs_transformers.py [--batch 16] [--input-len 32] [--output-len 128]
        [--threads N] [--skip-transformers] [--json]

The 256-bit code an AVX2-only host (CI's kind) runs, timed on an AVX-512 machine: both sides held to
AVX2 (shuili's compiled kernels, torch's own kernels, MKL's GEMMs); the cores, caches and memory
stay the host's, so it approximates such a host, it is not one:

    SHUILI_REFERENCE_NATIVE_CFLAGS=-mno-avx512f ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/cpu_vs_transformers.py --output-len 128 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def prompts(batch: int, input_len: int) -> list[list[int]]:
    # fixed, distinct token-id prompts inside SmolLM2's ordinary vocabulary
    return [[100 + (i * 977 + j * 131) % 20000 for j in range(input_len)] for i in range(batch)]


def run_shuili(ps: list[list[int]], output_len: int) -> dict:
    from shuili import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model="smollm2-135m", platform="reference", max_num_seqs=len(ps))
    load = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp)
    wall = time.perf_counter() - t0
    n = sum(len(_token_ids(o)) for o in outs)
    return {"load_s": load, "wall_s": wall, "tokens": n, "tok_per_s": n / wall}


def _token_ids(out) -> list[int]:
    if hasattr(out, "outputs"):  # vLLM-shaped RequestOutput
        return list(out.outputs[0].token_ids)
    return list(out.token_ids)


def run_transformers(ps: list[list[int]], output_len: int) -> dict:
    import transformers

    from shuili.core.models import llama

    path = llama.resolve_named("smollm2-135m")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    load = time.perf_counter() - t0
    ids = torch.tensor(ps)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        wall = time.perf_counter() - t0
    n = int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    return {"load_s": load, "wall_s": wall, "tokens": n, "tok_per_s": n / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ps = prompts(a.batch, a.input_len)
    res = {"batch": a.batch, "input_len": a.input_len, "output_len": a.output_len,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "native_cflags": os.environ.get("SHUILI_REFERENCE_NATIVE_CFLAGS", ""),
           "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""), "shuili": run_shuili(ps, a.output_len)}
    if not a.skip_transformers:
        import transformers

        res["transformers_version"] = transformers.__version__
        res["transformers"] = run_transformers(ps, a.output_len)
        res["ratio"] = res["shuili"]["tok_per_s"] / res["transformers"]["tok_per_s"]
    if a.json:
        print(json.dumps(res))
        return
    held = ", ".join(f"{k} {res[k]}" for k in ("native_cflags", "mkl_instructions") if res[k])
    print(f"batch {a.batch} x {a.output_len} new tokens, {res['threads']} threads, torch {torch.__version__}, "
          f"{res['cpu_capability']}" + (f" ({held})" if held else ""))
    for name in ("shuili", "transformers"):
        if name in res:
            r = res[name]
            print(f"{name:13s} load {r['load_s']:6.2f} s  decode {r['wall_s']:7.2f} s  {r['tok_per_s']:7.1f} tok/s")
    if "ratio" in res:
        print(f"shuili / transformers: {res['ratio']:.2f}x")


if __name__ == "__main__":
    main()
