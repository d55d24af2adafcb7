"""`dspark`: DeepSeek-V4.1's DSpark draft layers (v4_arch.md §2.9, §7) as a device drafter.

Runs inside the runner right after the target step samples, on the device, with no host sync:
  1. acceptance per sampling chunk (the exact-match rule of verify.py, as mtp.py does);
  2. context: the draft layers' window KV for every row of the step, from the target's tap
     features (`forward(keep_hidden=True)`); rows past the accepted drafts write KV at positions the
     next step rewrites before any draft query reads them (a block reads only positions < t);
  3. one block per request: [x_t, noise x (block_size - 1)] at t .. t + block_size - 1, x_t the
     target's sample at the chunk's last verified row (core/models/deepseek_v41_dspark.py);
  4. drafts one by one over the block's rows: base logits + the Markov bias of the previous token,
     each sampled with the target's counter-based noise at its position (a draft equal to the
     target's token is always accepted, greedy or sampled); confidence sigmoid(c_k) per draft;
  5. lengths: prefix survival prod_j<=k sigmoid(c_j); a draft is kept while its survival is
     >= min_confidence, the step's budget (num_speculative_tokens) goes to the highest survivals over
     all requests (mtp._budget), so a request whose first draft is unlikely gets none.
At most block_size drafts per request per step (one block). Nothing is read back here: the drafts
travel home with the step's tokens.
"""
from __future__ import annotations

import torch

from shuili.core.spec.base import Drafter
from shuili.core.spec.mtp import _budget, _host_layout


class DSparkDrafter(Drafter):
    name = "dspark"
    on_device = True
    needs_hidden = True

    @classmethod
    def unsupported(cls, model) -> str | None:
        if getattr(model, "cfg", None) is None or not hasattr(model.cfg, "dspark_block_size"):
            return "the model has no DSpark draft layers (dspark serves DeepSeek-V4.1 models)"
        if getattr(model, "dspark", None) is None:
            return ("the model was built without its DSpark draft layers (num_nextn_predict_layers = 0, or "
                    "loaded without the mtp.* weights)")
        return None

    def draft(self, runner, out, step, res) -> torch.Tensor:
        m, ds = self.model, self.model.dspark
        batch = step.batch
        C, T = sum(1 for c in out.chunks if c.sample), batch.num_tokens
        K = self.config.num_speculative_tokens
        b = min(K, m.cfg.dspark_block_size)
        h = _host_layout(out, T, len(step.sample_rows))
        i64 = torch.int64
        up = runner.transfer.upload({"base": (h["base"], i64), "chunk_seq": (h["chunk_seq"], i64),
                                     "dr": (h["drafts"], i64), "dr_row": (h["draft_rows"], i64),
                                     "lead": (h["lead"], i64)}, batch.input_ids.device)
        # 1. acceptance on the device
        kmax = max(h["kmax"], 1)
        dr, dr_row = up["dr"].view(C, kmax), up["dr_row"].view(C, kmax)
        acc = ((res.sampled[dr_row.clamp(min=0)] == dr) & (dr_row >= 0)).to(i64).cumprod(1).sum(1)  # [C]
        # 2. context KV of every row
        ds.write_context(batch, res.hidden)
        # 3. the block after each chunk's last verified row
        rows = up["base"] + acc
        anchor = res.sampled[up["lead"] + acc]
        t = batch.positions[rows].long() + 1
        hid, U = ds.block(anchor, t, batch.block_tables["swa_kv"][up["chunk_seq"]], batch.tokens_per_block)
        # 4. drafts in order, Markov bias from the previous token
        sb, lead = step.sampling, up["lead"]
        sample = dict(all_greedy=sb.all_greedy, any_filter=sb.any_filter)
        params = [x[lead] for x in (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeds)]
        prev, toks, confs = anchor, [], []
        for k in range(b):
            bias, c = ds.markov(prev, hid[:, k])
            prev = m.ops.sample(U[:, k] + bias, *params, t + 1 + k, **sample)
            toks.append(prev)
            confs.append(torch.sigmoid(c))
        # 5. lengths from the prefix survival, under the step's budget
        return _budget(torch.stack(toks, 1), torch.stack(confs, 1), K, self.config.min_confidence)
