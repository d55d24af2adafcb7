"""The op contract: every op the core and the models call, with shapes, dtypes and semantics.

Each function below is a specification, not an implementation: its signature is the call
signature every platform must accept, and its docstring the semantics the conformance suite checks
against the reference platform. Notation: T tokens of a flattened (varlen) batch, B sequences,
H query heads, D a head or hidden width, V vocabulary, E experts, k experts per token.
"compute dtype" is the platform's activation dtype (float32 on the reference platform).

Resolving a platform yields a `DispatchTable`: an immutable object whose attributes are these ops
bound to the platform's plain callables, so a call costs one attribute load and one Python call.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shuili.hal.types import Weight

OP_SPECS: dict[str, "OpSpec"] = {}


@dataclass(frozen=True)
class OpSpec:
    name: str
    category: str
    signature: inspect.Signature
    doc: str
    since: str  # HAL version that introduced the op

    @property
    def params(self) -> list[str]:
        return list(self.signature.parameters)

    @property
    def required(self) -> list[str]:
        """What every implementation must accept."""
        return [n for n in self.params if n not in self.hints]

    @property
    def hints(self) -> list[str]:
        """The keyword-only contract parameters: optional host hints (see `accepts`)."""
        return [n for n, p in self.signature.parameters.items() if p.kind is p.KEYWORD_ONLY]


def _op(category: str, since: str = "1.0"):
    def register(fn: Callable) -> Callable:
        OP_SPECS[fn.__name__] = OpSpec(
            fn.__name__, category, inspect.signature(fn), inspect.getdoc(fn) or "", since
        )
        return fn

    return register


# --------------------------------------------------------------------------------------------- GEMM
@_op("gemm")
def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias). x [T, K] compute dtype; W logical [N, K]; returns [T, N] compute dtype.

    W.format: "dense" (data in compute dtype), "fp8_block128" (e4m3 data, one power-of-two float32
    scale per 128x128 block: W[n,k] = data[n,k] * scale[n//128, k//128]), "fp8_block32" (the same
    with 32x32 blocks, K % 32 == 0: W[n,k] = data[n,k] * scale[n//32, k//32]) or "mxfp4" (e2m1
    nibbles, low nibble first, e8m0 scale per 32 along K). Activations are not quantized. Accumulation at
    least float32. Reference: dequantize W to float32, then a float32 matmul.
    """


@_op("gemm")
def grouped_linear(x: torch.Tensor, w: Weight, group_sizes: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM. x [M, K] rows sorted by group; W logical [E, N, K]; group_sizes int64 [E] sums
    to M. Rows [off_e, off_e + group_sizes[e]) use W[e]. Returns [M, N]. Formats as `linear`.
    """


@_op("gemm", since="1.10")
def block_diagonal_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """A linear whose weight is block diagonal, given as its G blocks. x [T, G*K]; W logical
    [G, N, K] (formats as `linear`); y[:, g*N:(g+1)*N] = x[:, g*K:(g+1)*K] @ W[g]^T. Returns
    [T, G*N] compute dtype. The values of `grouped_linear` over the rows regrouped by block (each
    output element is the same sum): V4's grouped output projection, without regrouping copies.
    """


@_op("moe")
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Weight,
    w2: Weight,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts with SwiGLU. x [T, D]; topk_ids int64 [T, k]; topk_weights float32 [T, k];
    w13 logical [E, 2I, D] (rows [0, I) gate, [I, 2I) up); w2 logical [E, D, I].
    For each (t, j): e = topk_ids[t, j];  g = x_t @ w13[e, :I]^T;  u = x_t @ w13[e, I:]^T;
    with a limit: g = min(g, limit), u = clamp(u, -limit, limit);  a = silu(g) * u  (float32);
    y_t = sum_j topk_weights[t, j] * (a @ w2[e]^T), summed over j in increasing j order.
    Returns [T, D] compute dtype. Ids outside [0, E) are an error.
    """


# ---------------------------------------------------------------------------------- elementwise etc
@_op("norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight, over the last dim, in float32, cast back to
    x's dtype. weight None means no weight (unweighted RMSNorm, used for the V4 per-head q norm).
    x [..., D]; weight [D].
    """


@_op("norm")
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: s = x + residual; returns (rms_norm(s, weight, eps), s).
    x, residual [T, D]. The sum is formed in x's dtype before the norm.
    """


@_op("rope")
def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleaved: bool = True,
    inverse: bool = False,
    *,
    may_overwrite: bool = False,
) -> torch.Tensor:
    """Rotary embedding on the LAST `rope_dim` channels of x [T, H, D] (D >= rope_dim); the first
    D - rope_dim channels pass through. positions int64 [T]; cos, sin float32 [max_pos, rope_dim/2]
    (precomputed tables; YaRN is folded into them by the model).
    interleaved=True pairs channels (2i, 2i+1) (GPT-J / DeepSeek); False pairs (i, i + rope_dim/2)
    (GPT-NeoX / Llama). Pair (a, b) with angle c + i s becomes (a c - b s, a s + b c); inverse=True
    rotates by the negative angle. Math in float32; returns x's dtype and shape (a new tensor).
    Host hint (HAL 1.11) may_overwrite=True: the caller never reads x again, so an implementation
    may write the result into x and return x (then only the rotated channels are rewritten: V4's
    attention output rotates 64 of 512). The result's values are the same either way.
    """


@_op("rope", since="1.9")
def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleaved: bool = True,
) -> torch.Tensor:
    """`rope(rms_norm(x, weight, eps), positions, cos, sin, rope_dim, interleaved)` over x [T, H, D]:
    each head row normalised over D and rounded to x's dtype, then its last rope_dim channels
    rotated, the same values as the two ops (V4's q and KV rows, and its compressed entries).
    Returns x's dtype and shape (a new tensor).
    """


@_op("activation")
def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate_up [T, 2I] = concat(gate, up); returns silu(gate') * up' [T, I] where, with a limit,
    gate' = min(gate, limit) and up' = clamp(up, -limit, limit). Math in float32.
    """


@_op("embedding")
def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of table [V, D] at ids int64 [T]; returns [T, D]. Ids outside [0, V) are an error."""


@_op("mhc")
def hc_split_sinkhorn(
    mix: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 mHC coefficients. mix float32 [T, m(m+2)] (m = hc_mult); scale [3]; base [m(m+2)].
    pre  = sigmoid(mix[:, :m] * scale[0] + base[:m]) + eps                      -> [T, m]
    post = 2 * sigmoid(mix[:, m:2m] * scale[1] + base[m:2m])                    -> [T, m]
    C    = softmax(mix[:, 2m:].view(m, m) * scale[2] + base[2m:].view(m, m), -1) + eps
    C    = C / (C.sum(-2) + eps); then (iters - 1) times: row-normalise, column-normalise
    (each: C / (C.sum(dim) + eps))                                              -> [T, m, m]
    Returns (pre, post, comb), all float32.
    """


@_op("mhc", since="1.7")
def hc_mix(
    x: torch.Tensor,
    fn: Weight,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 mHC coefficients of a layer, from the streams it reads: the unweighted norm, the
    mixing linear and hc_split_sinkhorn as one op. x [T, m, D] compute dtype (m = hc_mult); fn a
    dense float32 Weight [m(m+2), m*D]; scale [3]; base [m(m+2)].
    flat = rms_norm(x.reshape(T, m*D) in float32, None, norm_eps)
    mix  = linear(flat, fn) in float32                                          -> [T, m(m+2)]
    Returns hc_split_sinkhorn(mix, scale, base, m, iters, eps): (pre, post, comb), all float32.
    The mix is a float32 sum over m*D terms, accurate as `linear`'s (any fixed order); the rest as
    hc_split_sinkhorn. Row-local: token t's outputs depend only on x[t].
    """


@_op("mhc", since="1.4")
def engram_gate(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """DeepSeek-V4.1 Engram write into the residual streams. x [T, m, D] (m hc streams); kv
    [T, (m + 1) D] = wkv(the token's gathered table rows): m keys, then one shared value; q_weight,
    k_weight [m, D]. All in float32 (w = q_weight * k_weight elementwise):
    dot_k  = sum_D(x_k * w_k * key_k) * rsqrt(mean_D(x_k^2) + eps) * rsqrt(mean_D(key_k^2) + eps) / sqrt(D)
    gate_k = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6)))
    out_k  = x_k + gate_k * value                                               -> [T, m, D], x's dtype
    Each stream is normalised on its own (over D), not jointly over the m streams. Row-local: a
    token's output depends only on its own x and kv rows.
    """


@_op("mhc", since="1.6")
def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4 mHC collapse: the m residual streams into one layer input. x [T, m, D] compute
    dtype (m >= 1 hc streams); pre float32 [T, m] (hc_split_sinkhorn's first output).
    y[t, :] = sum_k pre[t, k] * x[t, k, :], each product and every sum in float32, the sum over k
    a fixed pairwise tree (`hal.numerics.tree_sum`: zero-pad m to a power of two, then add the
    upper half onto the lower half, element k pairing with k + width/2, until one is left); the
    result cast once to x's dtype                                               -> [T, D], x's dtype
    Row-local: token t's output depends only on x[t] and pre[t].
    """


@_op("mhc", since="1.6")
def hc_expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4 mHC expand: a layer's output written back into the m residual streams.
    f [T, D] compute dtype (the attention or MoE output); x [T, m, D] compute dtype (the streams
    the layer read); post float32 [T, m]; comb float32 [T, m, m] (hc_split_sinkhorn's second and
    third outputs). For each output stream k, in float32:
    out[t, k, :] = post[t, k] * f[t, :] + sum_j comb[t, j, k] * x[t, j, :]
    accumulated left to right: start from post[t, k] * f[t, :], then add comb[t, j, k] * x[t, j, :]
    for j = 0, 1, ..., m - 1 (each product rounded to float32 before its add); the result cast once
    to x's dtype                                                                -> [T, m, D], x's dtype
    Row-local: token t's output depends only on f[t], x[t], post[t] and comb[t].
    """


# ------------------------------------------------------------------------------------------ routing
@_op("moe")
def moe_route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    scoring: str,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert selection. logits float32 [T, E]; bias float32 [E] or None.
    scoring "sqrtsoftplus": s = sqrt(softplus(logits)); "softmax": s = softmax(logits, -1);
    "sigmoid": s = sigmoid(logits). ids = the topk of (s + bias) (bias changes selection only), ties
    to the lower expert id, ordered by descending biased score; w = s[ids], divided by its sum
    (+1e-20) when renormalize, times scaling. Returns (weights float32 [T, k], ids int64 [T, k]).
    """


@_op("moe")
def moe_route_hash(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    scoring: str,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4 layers < num_hash_layers): ids = tid2eid[token_ids] (int64 [T, k]),
    weights = score(logits)[ids], renormalised and scaled as in `moe_route_topk`.
    logits float32 [T, E]; token_ids int64 [T]; tid2eid int64 [V, k].
    """


# ---------------------------------------------------------------------------------------- KV cache
@_op("kv")
def kv_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Pack rows x [N, D] into a KV storage format; returns uint8 [N, bytes_per_row(fmt, D)]. x is
    float32, or bfloat16 / float16: their values are exact in float32 and are quantized as such.

    "mxfp8":    D e4m3 bytes, then D/32 e8m0 scale bytes (V4.1 window KV; 528 B for D = 512).
    "fp4_e4m3": D/2 bytes of e2m1 pairs (even element in the low nibble), then D/16 e4m3 scales
                (V4.1 compressed KV; 288 B for D = 512).
    "mxfp4":    D/2 bytes of e2m1 pairs, then D/32 e8m0 scales (indexer keys; 68 B for D = 128).
    Scales (ue8m0 formats): 2^ceil(log2(max(amax, floor) / elem_max)), exponent taken exactly from
    the float32 bits; elem_max 448 (e4m3) or 6 (e2m1); floor 1e-4 (mxfp8) or 6*2^-126 (mxfp4).
    fp4_e4m3 scale: e4m3(clamp(amax / 6, 2^-9, 448)) with RNE. Elements: clamp(x / scale, +-max),
    then round to nearest, ties to even.
    """


@_op("kv")
def kv_dequantize(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Inverse of `kv_quantize`: uint8 [N, bytes_per_row(fmt, dim)] -> float32 [N, dim], exact."""


@_op("kv")
def cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """In place: cache.view(-1, *values.shape[1:])[slot_mapping[i]] = values[i] for slot >= 0.
    cache [num_blocks, block_size, ...] (any dtype, incl. packed uint8 rows); slot_mapping int64
    [N] (slot = block * block_size + offset; negative = skip); values [N, ...] of cache's dtype.
    """


@_op("kv", since="1.9")
def kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
    """In place: `cache_write(cache, slot_mapping, kv_quantize(rows, fmt))`, or for fmt "none"
    `cache_write(cache, slot_mapping, rows.to(cache.dtype))`: a step's new KV rows packed into their
    storage format and stored at their slots, the same bytes as the two ops. rows [N, D] (float32,
    bfloat16 or float16); slot_mapping int64 [N] (negative = skip: the row need not be packed);
    cache [num_blocks, block_size, bytes_per_row(fmt, D)] uint8 for a packed format.
    """


@_op("kv", since="1.8")
def paged_slots(
    block_tables: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor, per_block: int
) -> torch.Tensor:
    """Cache slots of paged entries. block_tables int32 [B, max_blocks] (-1: no block); seq_idx and
    pos int64, broadcast against each other to one shape S; per_block > 0 entries per block.
    Returns int64 [S]: block_tables[seq, pos // per_block] * per_block + pos % per_block, or -1
    where pos < 0, pos // per_block >= max_blocks or that block is -1. seq_idx outside [0, B) is an
    error. Elementwise: each output depends only on its own (seq, pos) and the table.
    """


@_op("kv", since="1.6")
def compress_pool(
    state: torch.Tensor,
    src_slots: torch.Tensor,
    out_slots: torch.Tensor,
    offset: int,
    dim: int,
    overlap: bool,
) -> torch.Tensor:
    """DeepSeek-V4 KV compression: pool each completed entry's source tokens from the compressor
    state into one row. state float32 [S, W] (per-token state rows; W >= offset + 4 dim when
    overlap, else offset + 2 dim); src_slots int64 [N, L]: entry i's source tokens in order, as state
    rows (-1: no token; it takes no part); out_slots int64 [N]: -1 marks an entry not completed in
    this step (a fixed-shape decode step lists every token), whose output row is zeros and for which
    nothing is read. Token j of entry i, s = src_slots[i, j]:
      overlap False: kv = state[s, offset : offset+dim], gate = state[s, offset+dim : offset+2dim];
      overlap True (V4 CSA, L = 2r: the previous block's r tokens, then this block's r):
        j <  r: kv = state[s, offset       : offset+dim],  gate = state[s, offset+2dim : offset+3dim];
        j >= r: kv = state[s, offset+dim   : offset+2dim], gate = state[s, offset+3dim : offset+4dim].
    out[i, c] = sum_j softmax_j(gate[i, j, c]) kv[i, j, c]: a softmax over the entry's tokens, per
    channel c; an entry with no token gives zeros. Returns float32 [N, dim]. Row-local: entry i's
    row depends only on its own source rows.
    """


# --------------------------------------------------------------------------------------- attention
@_op("attention")
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a paged KV cache, for prefill chunks and decode alike.

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (H % KVH == 0; query head h reads
    kv head h // (H / KVH)); block_tables int32 [B, max_blocks] (logical block -> physical block;
    entries past a sequence's blocks are ignored); seq_lens int32 [B]: tokens in the cache for each
    sequence INCLUDING this step's tokens (which the caller wrote with `cache_write` first);
    query_start_loc int32 [B + 1]: sequence b's queries are q[qsl[b]:qsl[b+1]] and are its LAST
    q_len tokens, so query i has position p = seq_lens[b] - q_len + i.
    Query at position p sees kv positions j <= p, and j > p - window when window > 0.
    sinks float32 [H] or None: one extra logit per head in the softmax denominator, with no value.
    Softmax in float32; returns [T, H, D] in q's dtype.
    """


@_op("attention")
def sparse_attention(
    q: torch.Tensor,
    kv: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    scale: float,
    sinks: torch.Tensor | None = None,
    kv_formats: Sequence[str] | None = None,
) -> torch.Tensor:
    """Attention over explicitly selected entries, with K = V (DeepSeek-V4's shared latent).

    q [T, H, D]. kv: one or more caches, each viewable as rows [num_slots, row] (a paged pool
    [num_blocks, block_size, row]); indices: one int32 [T, L_i] per cache, slot ids into it, -1 for
    none. Query t attends to the union of its valid entries of all caches in ONE softmax (entries
    are not de-duplicated), plus sinks[h] in the denominator when given. kv_formats[i] is "none"
    (rows are float [D] in the compute dtype) or a `kv_quantize` format (rows are packed uint8,
    dequantized on read). A query with no valid entry and no sink returns zeros.
    Logits q·k * scale and softmax in float32; returns [T, H, D] in q's dtype.
    """


@_op("indexer")
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    topk: int,
    k_format: str = "none",
) -> torch.Tensor:
    """DeepSeek-V4 Lightning Indexer: scores and top-k over a sequence's compressed keys.

    q [T, H, Dk]; weights float32 [T, H]; k_cache [num_blocks, block_size, row]: entry e of
    sequence b lives at slot block_tables[b, e // block_size] * block_size + e % block_size
    (rows float [Dk], or packed per k_format); query_start_loc int32 [B + 1]; positions int64 [T].
    score[t, e] = sum_h weights[t, h] * relu(q[t, h] . k[e]) in float32, for the visible entries
    e < (positions[t] + 1) // ratio. Returns int32 [T, topk]: entry ids (within the sequence) of
    the topk highest scores, descending, ties to the lower entry id, padded with -1 when fewer are
    visible.
    """


@_op("indexer", since="1.4")
def indexer_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    topk: int,
    k_format: str = "none",
    candidates: torch.Tensor | None = None,
    candidate_topk: int = 0,
    candidate_block_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1 two-level indexer: `indexer_topk`'s scores, an optional candidate pool that
    restricts them, and an optional level-one selection of candidate blocks.

    Inputs and score[t, e] as `indexer_topk` (visible entries e < (positions[t] + 1) // ratio).
    Entry blocks: block j holds entries [j * S, (j + 1) * S), S = candidate_block_size.
    candidates int32 [T, C] or None: the blocks (ids within the sequence, -1 = none) query t may
    pick from; entries of other blocks score -inf.
    Level one (candidate_topk > 0; the candidate source layer, which passes candidates=None):
    block score = max of its visible entries' scores (-inf with none visible); the block holding
    the newest visible entry, (n_t - 1) // S, scores +inf (pinned); the candidate_topk highest
    blocks with a score > -inf, descending, ties to the lower block id, -1 padded.
    Returns (idx int32 [T, topk]: the topk highest finite-score visible entries, descending, ties
    to the lower entry id, -1 padded; cand int32 [T, candidate_topk], [T, 0] when
    candidate_topk == 0).
    """


# ---------------------------------------------------------------------------------------- sampling
@_op("sampling")
def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] any float dtype -> float32 log-probabilities [B, V] (max-subtracted,
    float32 exp/sum, fixed reduction order per row).
    """


@_op("sampling")
def apply_penalties(
    logits: torch.Tensor,
    token_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """logits float32 [B, V]; token_counts int32 [B, V] (occurrences in the generated output);
    prompt_mask bool [B, V] (token occurs in the prompt); repetition, presence, frequency float32 [B].
    Repetition (HF/vLLM rule) for tokens seen in prompt or output: l > 0 -> l / r, else l * r;
    then l -= frequency * count + presence * (count > 0). Returns a new float32 [B, V].
    """


@_op("sampling")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    all_greedy: bool | None = None,
    any_filter: bool | None = None,
) -> torch.Tensor:
    """Seeded, batch-invariant sampling. logits float32 [B, V] (penalties applied); temperature
    float32 [B] (0 = greedy); top_k int32 [B] (0 = off); top_p, min_p float32 [B] (1.0 / 0.0 = off);
    seeds int64 [B]; positions int64 [B] (absolute position of the token being sampled).
    Greedy: argmax, ties to the lowest token id. Otherwise: lp = log_softmax(logits / T); three
    INDEPENDENT masks, each computed on that full temperature-scaled distribution (top-k does not
    renormalise before top-p): outside top-k (rank by (lp desc, id asc)); outside the smallest top-p
    nucleus (cumulative float64 sum of p in that rank order; the token that crosses top_p is kept);
    p < min_p * p_max with p_max the overall top probability;
    token = argmax(lp + gumbel) over the kept tokens, ties to the lowest id, where
    gumbel = -log(-log(u)) in float64 and u = `shuili.hal.noise.uniform(seed, position, id)`,
    a counter-based hash strictly inside (0, 1). Returns int64 [B].
    Host hints (HAL 1.2, keyword-only, optional for implementations; the caller passes them only
    to an implementation that names them): all_greedy=True promises every temperature is 0;
    any_filter=False promises no row has top_k > 0, top_p < 1 or min_p > 0. Any other value
    promises nothing. They never change the result; they let an accelerator skip work without
    reading its tensors back on the host, a sync that would stall an overlapped engine.
    """


# ------------------------------------------------------------------------------------- collectives
@_op("collective")
def all_reduce(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Sum of x over the ranks of group (None = the world). With one rank: x itself. Deterministic
    platforms sum in a fixed rank order.
    """


@_op("collective")
def all_gather(x: torch.Tensor, group: object | None = None, dim: int = 0) -> torch.Tensor:
    """Concatenation of x from every rank of group along dim, in rank order. One rank: x."""


@_op("collective", since="1.4")
def all_to_all(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
               group: object | None = None) -> torch.Tensor:
    """Exchange rows between the ranks of group (None = the world): expert dispatch and combine.

    x [N, ...] holds the rows for rank 0, then rank 1, ...: send_counts[r] rows for rank r (W host
    ints, sum N). Returns [sum(recv_counts), ...] of x's dtype: the rows rank r sent to this rank,
    for r = 0, 1, ... in rank order, each source's rows in the order it sent them; recv_counts[r]
    must equal what rank r sends here (exchange counts first with a call on an int64 tensor [W]
    and unit counts). Rows are copied, never combined, so every platform is bitwise exact. With
    one rank: x itself (send_counts == recv_counts == [N]). Mismatched counts are an error.
    """


OP_NAMES: tuple[str, ...] = tuple(OP_SPECS)


class DispatchTable:
    """Immutable op table: `table.rms_norm(x, w, eps)` calls the platform's plain callable.

    Built once by `resolve_platform`; `sources[name]` records which platform provides each op
    (its own name, or "reference" for a declared fallback).
    """

    __slots__ = OP_NAMES + ("platform", "sources", "_frozen")

    def __init__(self, platform: str, impls: dict[str, Callable], sources: dict[str, str]):
        unknown = set(impls) - set(OP_NAMES)
        if unknown:
            raise ValueError(f"unknown ops {sorted(unknown)}; the contract has {list(OP_NAMES)}")
        missing = [n for n in OP_NAMES if n not in impls]
        if missing:
            raise ValueError(f"dispatch table for {platform!r} lacks ops {missing}")
        for name in OP_NAMES:
            object.__setattr__(self, name, impls[name])
        object.__setattr__(self, "platform", platform)
        object.__setattr__(self, "sources", dict(sources))
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name, value):
        raise AttributeError("DispatchTable is frozen; resolve a new platform instead")

    def __delattr__(self, name):
        raise AttributeError("DispatchTable is frozen")

    def get(self, name: str) -> Callable:
        return getattr(self, name)

    def as_dict(self) -> dict[str, Callable]:
        return {n: getattr(self, n) for n in OP_NAMES}

    def __repr__(self) -> str:
        fallbacks = sorted(n for n, s in self.sources.items() if s != self.platform)
        return f"DispatchTable(platform={self.platform!r}, fallbacks={fallbacks})"


def accepts(fn: Callable, keyword: str) -> bool:
    """Whether fn takes the optional contract keyword (callers pass hints only then)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def with_hints(name: str, fn: Callable) -> Callable:
    """fn, or a wrapper that drops the contract hints fn does not name, so every caller may pass
    them. Decided once, when the platform is resolved, not by inspecting fn on every call."""
    dropped = tuple(h for h in OP_SPECS[name].hints if not accepts(fn, h))
    if not dropped:
        return fn

    def adapted(*args, **kwargs):
        for h in dropped:
            kwargs.pop(h, None)
        return fn(*args, **kwargs)

    adapted.__name__ = getattr(fn, "__name__", name)
    adapted.__doc__ = getattr(fn, "__doc__", None)
    return adapted


def check_signature(name: str, fn: Callable) -> str | None:
    """None when fn accepts the contract's parameters by name, else the problem in words."""
    spec = OP_SPECS[name]
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins and C extensions: cannot inspect, trust the conformance suite
    params = got.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    wanted = spec.required
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if names[: len(wanted)] != wanted:
        return f"op {name!r} takes ({', '.join(wanted)}) but the implementation takes ({', '.join(names)})"
    return None
