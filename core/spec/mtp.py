"""`mtp`: DeepSeek-V4's MTP block (`DeepseekV4Model.forward_mtp`, v4_arch.md §2.9) as a device drafter.

Runs inside the runner right after the target step samples, on the device, with no host sync:
  1. acceptance: per sampling chunk, how many of its drafts equal the target's samples (the same
     exact-match rule the scheduler applies on the host, core/spec/verify.py);
  2. catch-up: the MTP block over every row of the step (input = the token after the row: the next
     row's input, or the target's sample on sampled rows, which equals the accepted draft there),
     writing its KV (the MTP layer of the swa_kv group) for those positions. Rows past the accepted
     drafts write KV at positions the next step recomputes before any query reads them;
  3. drafts: from the catch-up's logits at each chunk's last verified row, chained through the
     MTP block (token = the previous draft, hidden = the block's own output) up to
     num_speculative_tokens, each draft sampled with the target's counter-based noise at its
     position (so a drafter that matched the target would always be accepted, sampled or greedy);
  4. lengths: the confidence of draft j is the MTP's probability of it; a draft is kept while
     the product of confidences (its survival probability) is >= min_confidence, and the step's
     budget goes to the highest survivals over all requests. Nothing is read back here: the drafts
     travel home with the step's tokens.
Chained steps and the catch-up are eager (never in a decode graph).
"""
from __future__ import annotations

import dataclasses

import torch

from shuili.core.model_api import ForwardBatch
from shuili.core.spec.base import Drafter


class MtpDrafter(Drafter):
    name = "mtp"
    on_device = True
    needs_hidden = True

    @classmethod
    def unsupported(cls, model) -> str | None:
        if not hasattr(model, "forward_mtp"):
            return "the model has no MTP block (mtp serves DeepSeek-V4 models)"
        if getattr(model, "mtp", None) is None or not getattr(model, "with_mtp", False):
            return "the checkpoint has no mtp.* weights (or the model was loaded without them)"
        return None

    def draft(self, runner, out, step, res) -> torch.Tensor:
        m, dev = self.model, step.batch.input_ids.device
        batch, hidden = step.batch, res.hidden
        C, T = sum(1 for c in out.chunks if c.sample), batch.num_tokens
        K = self.config.num_speculative_tokens
        h = _host_layout(out, T, len(step.sample_rows))
        i64 = torch.int64
        up = runner.transfer.upload({"src": (h["src"], i64), "extra": (h["extra"], i64),
                                     "base": (h["base"], i64), "chunk_seq": (h["chunk_seq"], i64),
                                     "dr": (h["drafts"], i64), "dr_row": (h["draft_rows"], i64),
                                     "lead": (h["lead"], i64)}, dev)
        # 1. acceptance on the device: leading drafts equal to the target's samples
        kmax = max(h["kmax"], 1)
        dr, dr_row = up["dr"].view(C, kmax), up["dr_row"].view(C, kmax)
        eq = (res.sampled[dr_row.clamp(min=0)] == dr) & (dr_row >= 0)
        acc = eq.to(i64).cumprod(1).sum(1)  # [C]
        # 2. catch-up over every row; logits at each chunk's last verified row
        ids = torch.cat([batch.input_ids, res.sampled, up["extra"]])[up["src"]]
        rows = up["base"] + acc  # [C] input row of the last verified position
        mb = dataclasses.replace(batch, input_ids=ids, logits_indices=rows)
        logits = m.forward_mtp(mb, hidden, keep_hidden=True)
        x = m.last_mtp_hidden  # [C, m, D]
        pos = batch.positions[rows] + 2  # position of the first draft
        sb, lead = step.sampling, up["lead"]
        sample = dict(all_greedy=sb.all_greedy, any_filter=sb.any_filter)
        params = [t[lead] for t in (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeds)]
        toks, confs = [], []
        for j in range(K):
            tok = m.ops.sample(logits.float(), *params, pos + j, **sample)
            lp = m.ops.log_softmax(logits)
            toks.append(tok)
            confs.append(lp.gather(1, tok[:, None])[:, 0].float().exp())
            if j + 1 < K:
                logits = m.forward_mtp(_chain_batch(m.ops, batch, up["chunk_seq"], tok, pos + j - 1), x,
                                       keep_hidden=True)
                x = m.last_mtp_hidden
        return _budget(torch.stack(toks, 1), torch.stack(confs, 1), K, self.config.min_confidence)


def _host_layout(out, T: int, S: int) -> dict:
    """Host index lists (known when the step is built) for the device work above."""
    src, extra, base, chunk_seq, lead, drafts, draft_rows = [], [], [], [], [], [], []
    kmax = max((len(c.drafts) for c in out.chunks if c.sample), default=0)
    row, srow = 0, 0
    for b, c in enumerate(out.chunks):
        K = len(c.drafts)
        n_plain = c.num_tokens - (K + 1 if c.sample else 0)  # rows whose next input is the next row
        for r in range(c.num_tokens):
            if r < n_plain - (0 if c.sample else 1):
                src.append(row + r + 1)
            elif c.sample:
                src.append(T + srow + (r - n_plain))  # the target's sample after this row
            else:  # the chunk stops inside the known tokens: the next one is on the host
                nxt = c.req.tokens(c.end, c.end + 1)[0]
                src.append(T + S + len(extra))
                extra.append(max(nxt, 0))
        if c.sample:
            base.append(row + n_plain)
            chunk_seq.append(b)
            lead.append(srow)
            drafts += c.drafts + [-1] * (kmax - K)
            draft_rows += [srow + j for j in range(K)] + [-1] * (kmax - K)
            srow += K + 1
        row += c.num_tokens
    if kmax == 0:
        drafts, draft_rows, kmax = [-1] * len(base), [-1] * len(base), 1
    return dict(src=src, extra=extra, base=base, chunk_seq=chunk_seq, lead=lead, drafts=drafts,
                draft_rows=draft_rows, kmax=kmax)


def _chain_batch(ops, batch: ForwardBatch, seq: torch.Tensor, tok: torch.Tensor,
                 q: torch.Tensor) -> ForwardBatch:
    """One row per sampling chunk at position q (input: the draft at q + 1), shapes fixed by C only
    (static_decode: the positions live on the device). Its KV lands at q, which the next step's
    catch-up rewrites before any query reads it; past the block table nothing is written."""
    C, dev, P = tok.shape[0], tok.device, batch.tokens_per_block
    tables = {n: t[seq] for n, t in batch.block_tables.items()}
    ar = torch.arange(C, device=dev)
    none = torch.full((C,), -1, dtype=torch.int64, device=dev)
    slots = {n: ops.paged_slots(tables[n], ar, q, P) if n == "swa_kv" else none for n in batch.slot_mapping}
    return ForwardBatch(input_ids=tok, positions=q, query_start_loc=torch.arange(C + 1, dtype=torch.int32, device=dev),
                        seq_lens=(q + 1).int(), context_lens=q.int(), block_tables=tables, slot_mapping=slots,
                        logits_indices=ar, tokens_per_block=P, static_decode=True)


def _budget(toks: torch.Tensor, conf: torch.Tensor, budget: int, min_conf: float) -> torch.Tensor:
    """Keep each row's drafts while their survival (confidence product) >= min_conf; the step's
    budget goes to the highest survivals (a stable sort keeps each row's kept drafts a prefix)."""
    surv = conf.cumprod(1)
    ok = surv >= min_conf
    vals = torch.where(ok, surv, torch.full_like(surv, -1.0)).flatten()
    order = torch.sort(vals, descending=True, stable=True).indices[:budget]
    keep = torch.zeros_like(vals, dtype=torch.bool)
    keep[order] = True
    keep = keep.view_as(ok) & ok
    keep = keep.to(torch.int64).cumprod(1).bool()  # a prefix per row, whatever the ties did
    return torch.where(keep, toks, torch.full_like(toks, -1))
