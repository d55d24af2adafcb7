"""The torch_npu operator schemas this backend calls, vendored verbatim from torch_npu 2.13.0.

Source: the schema strings registered in `torch_npu/lib/libtorch_npu.so` of the torch-npu 2.13.0 wheel
(see docs/platforms/ascend.md). The simulator (`sim.py`) registers exactly these strings with
`torch.library`, so a call with a wrong keyword, a missing argument or a wrong argument type fails
in CI the same way it would on an NPU. `tests/ascend/test_schemas.py` checks they still match
torch_npu's own dump only where ../shared/reference/torch_npu_schemas.txt exists (not in CI).
"""
from __future__ import annotations

TORCH_NPU_VERSION = "2.13.0"

SCHEMAS: dict[str, str] = {
    'npu_fused_infer_attention_score': (
        'npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, '
        'Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, '
        'SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, '
        'Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, '
        'Tensor? quant_offset2=None, Tensor? antiquant_scale=None, '
        'Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, '
        'Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, '
        'Tensor? value_antiquant_offset=None, Tensor? block_table=None, '
        'Tensor? query_padding_size=None, Tensor? kv_padding_size=None, '
        'Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, '
        'SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, '
        'Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, '
        'float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, '
        'str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, '
        'int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, '
        'int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)'
    ),
    'npu_fused_infer_attention_score_v2': (
        'npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, '
        'Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, '
        'Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, '
        'SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, '
        'Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, '
        'Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, '
        'Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, '
        'Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, '
        'Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, '
        'int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, '
        'int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, '
        'int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, '
        'int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, '
        'int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, '
        'int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, '
        'int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, '
        'int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, '
        'int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> (Tensor, Tensor)'
    ),
    'npu_scatter_pa_kv_cache': (
        'npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, '
        'Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, '
        "Tensor? compress_seq_offsets=None, Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()"
    ),
    'npu_rms_norm': (
        'npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)'
    ),
    'npu_add_rms_norm': (
        'npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, '
        'Tensor, Tensor)'
    ),
    'npu_rotary_mul': (
        "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', "
        'Tensor? rotate=None) -> Tensor'
    ),
    'npu_swiglu': (
        'npu_swiglu(Tensor input, int dim=-1) -> Tensor'
    ),
    'npu_moe_gating_top_k': (
        'npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, '
        'Tensor? tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, '
        'int renorm=0, int norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, '
        'float eps=1e-20) -> (Tensor, Tensor, Tensor)'
    ),
    'npu_moe_init_routing_v2': (
        'npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, '
        'Tensor? offset=None, int active_num=-1, int expert_capacity=-1, int expert_num=-1, '
        'int drop_pad_mode=0, int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, '
        'int quant_mode=-1, int[2] active_expert_range=[], int row_idx_type=0, '
        'int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)'
    ),
    'npu_grouped_matmul': (
        'npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, '
        'Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, '
        'Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, '
        'Tensor? group_list=None, Tensor[]? activation_input=None, '
        'Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, '
        'int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0, '
        'int[]? tuning_config=None, int? output_dtype=None, int? x_dtype=None, '
        'int? weight_dtype=None, int? scale_dtype=None, '
        'int? per_token_scale_dtype=None) -> Tensor[]'
    ),
    'npu_moe_token_unpermute': (
        'npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, '
        'Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor'
    ),
    'npu_dynamic_mx_quant': (
        'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", '
        'int dst_type=296, int block_size=32, int? scale_alg=0, float dst_type_max=0.0, '
        'float max_low_bound=0.0) -> (Tensor, Tensor)'
    ),
    'npu_quant_matmul': (
        'npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, '
        'Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, '
        'int? x1_dtype=None, int? x2_dtype=None, int? pertoken_scale_dtype=None, '
        'int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor'
    ),
    'npu_lightning_indexer': (
        'npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, '
        'Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, '
        'Tensor? block_table=None, str layout_query="BSND", str layout_key="BSND", '
        'int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, '
        'int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)'
    ),
}
