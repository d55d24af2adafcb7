"""`shuili generate --input F [--output O]`: a batch job that never loses finished work.

Results are written as each input line finishes, NOT in input order: every record carries
"line" (the 1-based line number in F) and "id" (the line's "id", if it gave one); sort by "line"
to restore input order. Each record is one JSON line written with a single write() and flushed,
so a crash leaves a valid JSONL file (`--resume` also drops a torn last line, should a disk
fault leave one).

A line that is not JSON, not an object or a string, or has invalid parameters becomes an error
record {"line", "id", "error": "F:LINE: reason", "outputs": []} and the run goes on.
SIGINT/SIGTERM stop admitting lines and abort the running ones; everything finished is already
on disk. `--resume` skips every line that has a record in O (delete a line's error record to
retry it); each record carries the digest of its input line, so resuming against an input whose
answered lines were edited is refused rather than mixing answers to two different files.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field

from shuili.core.errors import FieldErrors
from shuili.core.outputs import RequestOutput
from shuili.core.request import Request
from shuili.core.sampling_params import SamplingParams

INTERRUPT_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


@dataclass
class Line:
    source: str
    number: int
    id: str | int | None
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None
    slots: list = field(default_factory=list)
    digest: str = ""


def line_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_line(path: str, number: int, text: str, defaults: dict) -> Line:
    where = f"{path}:{number}"
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(path, number, None, error=f"{where}: not valid JSON: {exc.msg} (column {exc.colno})")
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        return Line(path, number, None, error=f"{where}: expected a string or an object with \"prompt\", "
                                        f"got {type(item).__name__}")
    rid = item.pop("id", None)
    if "prompt" not in item:
        return Line(path, number, rid, error=f"{where}: the object has no \"prompt\"")
    prompt = item.pop("prompt")
    if not isinstance(prompt, (str, list)):
        return Line(path, number, rid, error=f"{where}: prompt must be a string or a list of token ids, "
                                       f"got {type(prompt).__name__}")
    try:
        params = SamplingParams(**{**defaults, **item})
    except FieldErrors as exc:
        return Line(path, number, rid, error=f"{where}: " + "; ".join(exc.problems))
    return Line(path, number, rid, prompt, params)


def read_input(path: str, defaults: dict) -> list[Line]:
    """Every non-blank line of the input, parsed or with its error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path!r} does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, text.strip()) for n, text in enumerate(f, 1) if text.strip()]
    out = []
    for n, text in lines:
        line = parse_line(path, n, text, defaults)
        line.digest = line_digest(text)
        out.append(line)
    return out


def done_lines(path: str) -> dict[int, str | None]:
    """Line numbers already answered in an output file, each with its input digest (None in
    records written before digests existed); a torn last record is cut off."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = {}
    for n, raw in enumerate(data[:keep].splitlines(), 1):
        try:
            rec = json.loads(raw)
            done[int(rec["line"])] = rec.get("input_digest")
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{n} is not a result record of `shuili generate --input`; "
                             "--resume continues only its own output files") from None
    return done


def check_unchanged(path: str, lines: list[Line], done: dict[int, str | None]) -> None:
    """--resume: every answered line must still read as it did when it was answered."""
    now = {x.number: x.digest for x in lines}
    for number, digest in sorted(done.items()):
        if digest is not None and now.get(number) != digest:
            what = "is gone" if number not in now else "has changed"
            raise ValueError(f"--input {path!r} line {number} {what} since its answer was written; "
                             "--resume continues only the input it started with (restore it, or write "
                             "to a new --output)")


def open_output(path: str, resume: bool) -> tuple[int, dict[int, str | None]]:
    """Checked before any work: an fd open for appending, and the lines it already answers."""
    if os.path.isdir(path):
        raise ValueError(f"--output {path!r} is a directory; give a file path")
    if not resume and os.path.exists(path) and os.path.getsize(path) > 0:
        raise ValueError(f"--output {path!r} already has results; pass --resume to continue it, "
                         "or remove it")
    done = done_lines(path) if resume else {}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise ValueError(f"cannot write --output {path!r}: {exc.strerror}") from None
    return fd, done


def completion_record(c) -> dict:
    return {"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs,
            "finish_reason": c.finish_reason, "seed": c.seed, "error": c.error}


def line_record(line: Line, out=None) -> dict:
    outputs = [completion_record(c) for c in out.outputs] if out is not None else []
    error = line.error or next((f"{line.source}:{line.number}: {c['error']}" for c in outputs if c["error"]), None)
    return {"line": line.number, "id": line.id, "prompt": line.prompt, "error": error, "outputs": outputs,
            "input_digest": line.digest}


class Sink:
    """One JSON line per record, each with a single write so a record is never torn."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def write(self, rec: dict) -> None:
        text = json.dumps(rec) + "\n"
        if self.fd is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        data = text.encode()
        while data:
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


class _Stop:
    """First SIGINT/SIGTERM: finish cleanly after the current step. A second: stop now."""

    def __init__(self):
        self.signum = None
        self._old = {s: signal.signal(s, self._handle) for s in INTERRUPT_EXIT}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclass
class Summary:
    pending: int
    written: int = 0
    failed: int = 0
    signum: int | None = None

    @property
    def remaining(self) -> int:
        return self.pending - self.written


def run(llm, lines: list[Line], sink: Sink, chat: bool, progress=None) -> Summary:
    """Answer `lines` (the ones not yet done) through the engine, writing each as it finishes."""
    summary = Summary(pending=len(lines))
    for line in (x for x in lines if x.error is not None):
        _write(sink, summary, line)
    todo = [x for x in lines if x.error is None][::-1]
    window = 2 * llm.engine.config.max_num_seqs  # admit lazily: a huge file is not tokenized up front
    running: dict[str, tuple[Request, Line]] = {}
    stop = _Stop()
    try:
        while (todo or running) and stop.signum is None:
            while todo and len(running) < window:
                _admit(llm, todo.pop(), running, sink, summary, chat)
            if running:
                llm.engine.step_requests()
            # polled, not taken from step's touched list: requests failed outside a step's
            # sampling (no KV blocks, a model fault) finish without being reported there
            for rid in [rid for rid, (req, _) in running.items() if req.finished]:
                _finish(llm, running, rid, sink, summary)
            if progress is not None:
                progress(summary.written)
        if stop.signum is not None:
            for rid in list(running):
                llm.engine.abort(rid)
            summary.signum = stop.signum
    finally:
        stop.restore()
    return summary


def _admit(llm, line: Line, running: dict, sink: Sink, summary: Summary, chat: bool) -> None:
    line.slots = llm._expand(line.number, line.prompt, line.params, 0, chat)
    live = [s for s in line.slots if isinstance(s, Request)]
    if not live:
        _write(sink, summary, line, _group(llm, line))
    for req in live:
        running[req.request_id] = (req, line)


def _finish(llm, running: dict, rid: str, sink: Sink, summary: Summary) -> None:
    _, line = running.pop(rid)
    if not any(isinstance(s, Request) and s.request_id in running for s in line.slots):
        _write(sink, summary, line, _group(llm, line))


def _group(llm, line: Line) -> RequestOutput:
    from shuili.core.api import _group as group

    return group([llm._output(s) for s in line.slots])


def _write(sink: Sink, summary: Summary, line: Line, out: RequestOutput | None = None) -> None:
    rec = line_record(line, out)
    sink.write(rec)
    summary.written += 1
    summary.failed += rec["error"] is not None or any(c["finish_reason"] == "error" for c in rec["outputs"])
    if rec["error"] is not None:
        print(f"shuili: error: {rec['error']}", file=sys.stderr)
