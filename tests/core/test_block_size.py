"""tokens_per_block left unset takes the smallest block the model's cache groups fit (a multiple of 16 that
every ratio divides): mid-v4's 128-token HCA entries no longer break `LLM(model="mid-v4")` with defaults."""
import pytest

from shuili.core.api import LLM
from shuili.core.config import EngineConfig
from shuili.core.model_api import CacheGroupSpec, default_tokens_per_block
from shuili.core.models.deepseek_v4 import build
from shuili.core.models.deepseek_v4_cache import cache_groups
from shuili.core.models.deepseek_v4_config import named
from shuili.core.sampling_params import SamplingParams


def _compressed(*ratios):
    return [CacheGroupSpec(name=f"c{r}", kind="compressed", layers=(0,), entry_shape=(1,), ratio=r) for r in ratios]


def test_the_rule():
    assert default_tokens_per_block(cache_groups(named("mid-v4"), "float32")) == 128
    assert default_tokens_per_block(cache_groups(named("tiny-v4"), "float32")) == 16
    assert default_tokens_per_block(_compressed(1, 2)) == 16          # V4.1's ratios
    assert default_tokens_per_block(_compressed(3, 4)) == 48
    assert EngineConfig().tokens_per_block is None


def _hca128(ops, device, dtype, seed):
    # tiny-v4 with mid-v4's HCA ratio: the case that failed with the old fixed default of 16
    return build("tiny-v4", ops, device=device, dtype=dtype, seed=seed, hca_ratio=128)


def test_unset_block_size_fits_the_model():
    llm = LLM(model=_hca128, platform="reference", max_num_seqs=2, num_blocks=8, max_model_len=512)
    assert llm.engine.kv.P == 128 and llm.engine.runner.P == 128
    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_set_block_size_is_kept_and_checked():
    llm = LLM(model=_hca128, platform="reference", max_num_seqs=2, num_blocks=4, max_model_len=512,
              tokens_per_block=256)
    assert llm.engine.kv.P == 256
    with pytest.raises(ValueError, match="tokens_per_block 16 is not a multiple of group hca_kv's ratio 128; "
                                         "use a multiple of 128, or leave tokens_per_block unset"):
        LLM(model=_hca128, platform="reference", max_num_seqs=2, num_blocks=8, max_model_len=512,
            tokens_per_block=16)
