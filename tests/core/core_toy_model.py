"""A small Model for engine tests: 2 attention layers through HAL ops, a full and a sliding group.

Layer 0 attends over everything (group "full"), layer 1 over the last `window` tokens (group
"swa"), so both KV group kinds are exercised. Byte-level tokenizer: ids 0..255 are bytes,
256 = EOS. `nan_token`: any sequence whose step inputs contain it gets NaN logits (for the
per-request error tests). `naive_linear`: plain torch matmuls instead of the HAL op, the
negative control of the invariance tests.
"""
from __future__ import annotations

import torch

from shuili.core.model_api import CacheGroupSpec, ForwardBatch
from shuili.hal import Weight

EOS = 256


class ByteTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = 260

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ToyModel:
    name = "toy"

    def __init__(self, ops, device="cpu", dtype="float32", seed=0, hidden=32, heads=4, kv_heads=2,
                 window=8, max_model_len=256, nan_token: int | None = None, naive_linear: bool = False):
        self.ops, self.device = ops, device
        self.tokenizer = ByteTokenizer()
        self.vocab_size = ByteTokenizer.vocab_size
        self.max_model_len = max_model_len
        self.H, self.KVH, self.D = heads, kv_heads, hidden // heads
        self.window = window
        self.nan_token = nan_token
        if naive_linear:  # the negative control: torch's CPU GEMM is not batch-invariant
            self.ops = _NaiveOps(ops)
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5).to(device)

        V, E, hd = self.vocab_size, hidden, self.D
        self.embed = w(V, E, scale=3.0)
        self.layers = []
        for _ in range(2):
            self.layers.append({
                "norm1": torch.ones(E, device=device), "norm2": torch.ones(E, device=device),
                "wq": Weight.dense(w(heads * hd, E)), "wk": Weight.dense(w(kv_heads * hd, E)),
                "wo": Weight.dense(w(E, heads * hd)),
                "w13": Weight.dense(w(4 * E, E)), "w2": Weight.dense(w(E, 2 * E)),
            })
        self.final_norm = torch.ones(E, device=device)
        self.lm_head = Weight.dense(w(V, E, scale=4.0))
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(max_model_len, dtype=torch.float32)[:, None] * inv[None]
        self.cos, self.sin = ang.cos().to(device), ang.sin().to(device)
        self.caches: dict[str, list[torch.Tensor]] = {}

    def cache_groups(self) -> list[CacheGroupSpec]:
        shape = (self.KVH, self.D)  # K = V (a shared latent, as in DeepSeek-V4)
        return [CacheGroupSpec(name="full", kind="full", layers=(0,), entry_shape=shape),
                CacheGroupSpec(name="swa", kind="sliding", layers=(1,), entry_shape=shape,
                               window=self.window)]

    def bind_caches(self, caches, tokens_per_block):
        self.caches = caches

    def apply_chat_template(self, prompt: str) -> str:
        return f"<user>{prompt}<bot>"

    def _attention(self, i: int, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ops, L, T = self.ops, self.layers[i], h.shape[0]
        group = "full" if i == 0 else "swa"
        q = ops.linear(h, L["wq"]).view(T, self.H, self.D)
        k = ops.linear(h, L["wk"]).view(T, self.KVH, self.D)
        q = ops.rope(q, batch.positions, self.cos, self.sin, self.D)
        k = ops.rope(k, batch.positions, self.cos, self.sin, self.D)
        cache = self.caches[group][0]
        ops.cache_write(cache, batch.slot_mapping[group], k)
        o = ops.paged_attention(q, cache, cache, batch.block_tables[group],
                                batch.seq_lens, batch.query_start_loc, self.D ** -0.5,
                                window=self.window if group == "swa" else 0)
        return ops.linear(o.reshape(T, self.H * self.D), L["wo"])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        ops = self.ops
        x = ops.embedding(batch.input_ids, self.embed)
        for i, L in enumerate(self.layers):
            x = x + self._attention(i, ops.rms_norm(x, L["norm1"], 1e-6), batch)
            m = ops.swiglu(ops.linear(ops.rms_norm(x, L["norm2"], 1e-6), L["w13"]))
            x = x + ops.linear(m, L["w2"])
        x = ops.rms_norm(x[batch.logits_indices], self.final_norm, 1e-6)
        logits = ops.linear(x, self.lm_head)
        if self.nan_token is not None:
            logits = self._poison(logits, batch)
        return logits

    def _poison(self, logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qsl = batch.query_start_loc_cpu
        bad_rows = set()
        for b in range(len(qsl) - 1):
            if (batch.input_ids[qsl[b]:qsl[b + 1]] == self.nan_token).any():
                bad_rows.update(range(qsl[b], qsl[b + 1]))
        mask = torch.tensor([int(r) in bad_rows for r in batch.logits_indices.tolist()], dtype=torch.bool,
                            device=logits.device)
        return torch.where(mask[:, None], torch.full_like(logits, float("nan")), logits)


class _NaiveOps:
    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    @staticmethod
    def linear(x, w, bias=None):
        return x @ w.data.t()


def factory(**kw):
    """A model factory for `LLM(model=factory(...))`."""
    def make(ops, device, dtype, seed):
        return ToyModel(ops, device, dtype, seed, **kw)

    make.name = "toy"
    return make
