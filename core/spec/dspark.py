"""`dspark`: DeepSeek-V4.1's draft layers (v4_arch.md §2.9, §7), NOT IMPLEMENTED YET.

How it plugs in once the V4.1 model exists in core/models (docs/speculative.md has the plan):
a device drafter (`on_device = True`, `needs_hidden = True`) whose `draft` takes the attention
inputs of layers 37-39 the target step kept, runs `main_proj`/`main_norm` and the three draft
blocks over `[x_t, noise x 4]` (noise id 128799, block drafting, window attention over the main
KV plus the block), adds the Markov head's bigram bias, samples each draft with the target's
counter-based noise, and chooses per-request lengths from the confidence head's
sigmoid(c_k) products under the step's budget, exactly as `mtp.py` does with its own confidences.
"""
from __future__ import annotations

from shuili.core.spec.base import Drafter


class DSparkDrafter(Drafter):
    name = "dspark"
    on_device = True
    needs_hidden = True

    @classmethod
    def unsupported(cls, model) -> str | None:
        return ("dspark drafts with DeepSeek-V4.1's draft layers, and shuili has no V4.1 model yet "
                "(not available for this model yet)")
