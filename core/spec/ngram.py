"""`ngram`: prompt lookup. The last n tokens of a request (n from prompt_lookup_max down to
prompt_lookup_min) are searched for earlier in the same request's prompt + output; the tokens that
followed the latest earlier occurrence are the drafts. Model-free, on the host, where the tokens are.

Lengths: a match of n tokens earns at most n + 1 drafts (a short match is weak evidence), and the
step's budget goes to the longest matches first. No match, no drafts.
"""
from __future__ import annotations

from shuili.core.request import Request
from shuili.core.spec.base import Drafter, draftable


def lookup(tokens: list[int], n_max: int, n_min: int, k: int) -> tuple[int, list[int]]:
    """(match length n, up to k tokens that followed the latest earlier occurrence of the last n)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        first = suffix[0]
        for s in range(L - n - 1, -1, -1):  # latest occurrence first; it must end before the suffix
            if tokens[s] == first and tokens[s:s + n] == suffix:
                return n, tokens[s + n:s + n + k]
    return 0, []


class NgramDrafter(Drafter):
    name = "ngram"

    def propose(self, requests: list[Request]) -> None:
        c = self.config
        K = c.num_speculative_tokens
        found = []
        for req in requests:
            if not draftable(req, self.max_model_len):
                continue
            req.draft_token_ids = []  # last step's unscheduled drafts are not carried over
            # with a token in flight (overlap mode) the match's first token is the guess for it
            skip = req.num_placeholders
            n, cont = lookup(req.prompt_token_ids + req.output_token_ids, c.prompt_lookup_max,
                             c.prompt_lookup_min, K + skip)
            cont = cont[skip:]
            if cont:
                found.append((n, req, cont[:n + 1]))
        budget = K
        for n, req, cont in sorted(found, key=lambda x: -x[0]):  # stable: admission order breaks ties
            if budget <= 0:
                break
            req.draft_token_ids = cont[:budget]
            budget -= len(req.draft_token_ids)
