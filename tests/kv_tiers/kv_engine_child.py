"""A fresh engine process on a store directory (tests/kv_tiers): answers the prompts and prints
{"bits": [[token ids, logprob bytes as hex], ...], "stats": tier stats} as JSON."""
import json
import struct
import sys

import torch

from shuili import LLM, SamplingParams


def main(spec: str) -> None:
    torch.set_num_threads(1)
    s = json.loads(spec)
    llm = LLM(model=s["model"], platform="reference", **s["engine"])
    outs = llm.generate(s["prompts"], [SamplingParams(**p) for p in s["params"]])
    llm.engine.scheduler.check()
    llm.engine.kv_tiers.flush()
    print(json.dumps({"bits": [[o.token_ids, [struct.pack("<f", x).hex() for x in o.logprobs]] for o in outs],
                      "stats": llm.engine.kv_tiers.stats()}))


if __name__ == "__main__":
    main(sys.argv[1])
