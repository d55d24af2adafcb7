"""Cross-host lock (link-count protocol), atomic writes, baseline comparison."""
import json
import multiprocessing as mp
import os
import time

import pytest

from shuili.conformance import baselines
from shuili.conformance import lock as lockmod
from shuili.conformance.lock import HostSafeLock, LockTimeout, atomic_write


def _hold(path, counter, n):
    for _ in range(n):
        with HostSafeLock(path, timeout=60):
            v = int(open(counter).read())
            time.sleep(0.001)
            atomic_write(counter, str(v + 1))


def test_lock_serialises_processes(tmp_path):
    counter = tmp_path / "count"
    counter.write_text("0")
    lock = str(tmp_path / "l.lock")
    procs = [mp.get_context("fork").Process(target=_hold, args=(lock, str(counter), 15)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert counter.read_text() == "45"  # no lost update: the read-modify-write was exclusive
    assert not os.path.exists(lock)
    assert [f for f in os.listdir(tmp_path) if f.startswith("l.lock")] == []


def test_lock_times_out_naming_holder_and_breaks_dead_holder(tmp_path):
    path = str(tmp_path / "x.lock")
    held = HostSafeLock(path).acquire()
    with pytest.raises(LockTimeout, match="held by"):
        HostSafeLock(path, timeout=0.2).acquire()
    held.release()
    # a holder on this host whose process is gone is broken at once
    json.dump({"host": held.host, "pid": 2 ** 22 + 12345, "token": "dead"}, open(path, "w"))
    with HostSafeLock(path, timeout=5) as lk:
        assert lk.held
    assert not os.path.exists(path)


def test_lock_breaks_stale_lock_by_age(tmp_path):
    path = str(tmp_path / "y.lock")
    json.dump({"host": "another-host", "pid": 1, "token": "old"}, open(path, "w"))
    old = time.time() - 7200
    os.utime(path, (old, old))
    with HostSafeLock(path, timeout=5, stale_after=60) as lk:
        assert lk.held


DEAD_PID = 2 ** 22 + 12345  # above the kernel's pid_max default: no such process


def _dead_lock(path, host):
    json.dump({"host": host, "pid": DEAD_PID, "token": "dead"}, open(path, "w"))


def _lock_files(tmp_path, name):
    return sorted(f for f in os.listdir(tmp_path) if f.startswith(name))


def test_two_breakers_of_one_stale_lock_leave_one_holder(tmp_path):
    """Both see the same dead holder; a breaks it and takes the lock before b acts on what it saw.
    b must not break a's lock: exactly one holder."""
    path = str(tmp_path / "r.lock")
    a, b = HostSafeLock(path, timeout=5), HostSafeLock(path, timeout=0.5)
    _dead_lock(path, a.host)
    b_break, fired = b._break, []

    def late(*seen):
        if not fired:
            fired.append(a.acquire())
        return b_break(*seen)

    b._break = late
    with pytest.raises(LockTimeout, match=f"pid {os.getpid()}"):
        b.acquire()
    assert fired and a.held and not b.held
    assert json.load(open(path))["token"] == a.token
    assert _lock_files(tmp_path, "r.lock") == ["r.lock", os.path.basename(a._mine)]
    a.release()
    assert _lock_files(tmp_path, "r.lock") == []


def test_a_breaker_holding_the_claim_excludes_the_others(tmp_path, monkeypatch):
    """b has claimed the break of a stale lock and not yet renamed it; c, which saw the same stale
    lock, must neither break it nor take the lock meanwhile."""
    path = str(tmp_path / "s.lock")
    b, c = HostSafeLock(path, timeout=5), HostSafeLock(path, timeout=0.3)
    _dead_lock(path, b.host)
    look, fired = lockmod._look, []

    def look_after_claim(p):
        if not fired and any(".break." in f for f in os.listdir(tmp_path)):
            fired.append(1)
            with pytest.raises(LockTimeout, match=f"pid {DEAD_PID}"):
                c.acquire()
            assert json.load(open(path))["token"] == "dead"
        return look(p)

    monkeypatch.setattr(lockmod, "_look", look_after_claim)
    with b:
        assert fired and b.held and not c.held
        assert json.load(open(path))["token"] == b.token
    assert _lock_files(tmp_path, "s.lock") == []


def test_a_dead_breakers_claim_is_passed_over(tmp_path):
    path = str(tmp_path / "t.lock")
    lk = HostSafeLock(path, timeout=5)
    _dead_lock(path, lk.host)
    claim = lk._claim_name(lockmod._look(path), 0)
    json.dump({"host": lk.host, "pid": DEAD_PID, "token": "crashed"}, open(claim, "w"))
    with lk:
        assert json.load(open(path))["token"] == lk.token
        assert not os.path.exists(claim)
    assert _lock_files(tmp_path, "t.lock") == []


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "b.json"
    atomic_write(str(p), "one")
    atomic_write(str(p), "two")
    assert p.read_text() == "two"
    assert os.listdir(tmp_path) == ["b.json"]


def _body(tokens, lps, platform="reference"):
    return {"platform": platform, "workload": "w",
            "modes": {"greedy": {"samples": [baselines.sample_record([1, 2, 3], tokens, lps)]}}}


def test_baseline_roundtrip_and_compare(tmp_path):
    root = str(tmp_path)
    fp = {"platform": "reference", "torch": "x", "sha256": "aaaa"}
    cur = _body([5, 6], [-1.5, -0.25])
    assert baselines.compare(None, cur, fp, "baseline.w", root).status == "skip"
    data = baselines.build("reference", "w", {m: v["samples"] for m, v in cur["modes"].items()},
                           {"fingerprint": fp, "created": "now"})
    path = baselines.update(root, data)
    assert path == os.path.join(root, "reference", "w.json")
    locked = baselines.load(root, "reference", "w")
    assert baselines.compare(locked, cur, fp, "baseline.w", root).status == "pass"
    # one ulp in one logprob: same tokens, other bits
    ulp = _body([5, 6], [-1.5, -0.25000003])
    res = baselines.compare(locked, ulp, fp, "baseline.w", root)
    assert res.status == "fail" and "bits hash" in res.message
    tok = baselines.compare(locked, _body([5, 7], [-1.5, -0.25]), fp, "baseline.w", root)
    assert tok.status == "fail" and tok.divergence.where["step"] == 1
    # another stack: bits not comparable, perplexity still held
    other = dict(fp, torch="y", sha256="bbbb")
    assert baselines.compare(locked, ulp, other, "baseline.w", root).status == "info"
    assert baselines.compare(locked, _body([5, 6], [-3.0, -0.25]), other, "baseline.w", root).status == "fail"


def test_baseline_names_are_checked(tmp_path):
    with pytest.raises(ValueError, match="cannot name a baseline file"):
        baselines.path_for(str(tmp_path), "../etc", "w")


def _ref():
    from shuili.hal import PlatformConfig, resolve_platform

    return resolve_platform(PlatformConfig(platform="reference"))


def test_ops_added_since_a_lock_keep_its_bits_comparable():
    rp = _ref()
    fp, levels = baselines.stack_fingerprint(rp), baselines.op_levels(rp)
    older = dict(levels)
    new_op = sorted(older)[0]
    del older[new_op]  # a baseline locked before this op joined the contract
    locked = {"provenance": {"fingerprint": {**fp, "op_levels": "0ld", "sha256": "0ld"},
                             "determinism": {"op_levels": older}}}
    assert baselines.same_stack(locked, fp, levels)
    assert not baselines.same_stack(locked, fp)  # without this stack's levels: only the hash counts
    changed = dict(older)
    op = sorted(changed)[0]
    changed[op] = "run_to_run" if changed[op] != "run_to_run" else "portable_bitwise"
    locked["provenance"]["determinism"]["op_levels"] = changed  # an op it used changed its level
    assert not baselines.same_stack(locked, fp, levels)
    locked["provenance"]["determinism"]["op_levels"] = older
    locked["provenance"]["fingerprint"]["torch"] = "0.0"  # another torch: another stack
    assert not baselines.same_stack(locked, fp, levels)


@pytest.mark.parametrize("workload", ["tiny-v4", "tiny-v4-quick", "smollm2-135m", "tiny-v41"])
def test_committed_reference_baselines_are_compared_bit_for_bit(workload):
    """The reference's committed baselines must stay comparable (bits, not perplexity): a new op
    in the contract once made every one of them 'another stack' without anyone noticing."""
    rp = _ref()
    root = os.path.join(os.path.dirname(baselines.__file__), "baselines")
    base = baselines.load(root, "reference", workload)
    assert base is not None, f"no committed reference baseline for {workload}"
    fp = baselines.stack_fingerprint(rp)
    locked = base["provenance"]["fingerprint"]
    if locked.get("torch") != fp["torch"]:
        pytest.skip(f"baseline locked under torch {locked.get('torch')}, this is {fp['torch']}")
    assert baselines.same_stack(base, fp, baselines.op_levels(rp)), \
        {k: (locked.get(k), fp[k]) for k in fp if locked.get(k) != fp[k]}
