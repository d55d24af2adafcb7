"""A second process on one store directory (tests/kv_tiers/test_kv_store.py): writes its keys, and
between writes reads every key the directory shows, checking the bytes. Prints a JSON summary."""
import json
import random
import sys

import torch

from shuili.core.kv_tiers.disk_store import DiskStore


def block(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"a": torch.randint(0, 1 << 30, (2, 4, 256), generator=g, dtype=torch.int64).float(),
            "b": torch.randint(0, 255, (1, 2, 300), generator=g, dtype=torch.int64).to(torch.uint8)}


EXPECT = {"a": ((2, 4, 256), torch.float32), "b": ((1, 2, 300), torch.uint8)}


def key(i: int) -> str:
    return f"{i:064x}"


def main(root: str, order: str, n: int, seed: int) -> None:
    store = DiskStore(root, "fp-test", background=True)
    keys = list(range(n)) if order == "up" else list(range(n - 1, -1, -1))
    rng = random.Random(seed)
    bad, reads = 0, 0
    def read(j: int) -> int:
        got = store.get(key(j), EXPECT)
        want = block(j)
        return int(got is None or any(not torch.equal(got[k], want[k]) for k in want))

    for i in keys:
        store.put(key(i), i.to_bytes(8, "little"), block(i))
        for _ in range(3):
            j = rng.randrange(n)
            if store.contains(key(j)):
                bad += read(j)
                reads += 1
    # the background writer may not have landed anything yet on a busy host (then the loop above
    # read nothing): once flushed, every key this process wrote is there, whatever the machine's speed
    store.flush()
    for j in keys:
        if store.contains(key(j)):
            bad += read(j)
            reads += 1
    print(json.dumps({"bad": bad, "reads": reads, **store.stats()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
