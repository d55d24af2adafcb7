"""User-facing error text: one line per problem, naming the field (or file and line) and the fix.

Shared by the API, the CLI, the batch job and the server, so a bad `temperature` reads the same
everywhere:
    temperature: must be >= 0 (0 = greedy), got -1
"""
from __future__ import annotations

from pydantic import ValidationError


class FieldErrors(ValueError):
    """Invalid fields of a config or params object: str() is one line per field; `.problems`
    lists them (a server can return them as they are)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ReadableErrors:
    """Mixin for pydantic models built by users (SamplingParams, EngineConfig): construction
    raises FieldErrors (a ValueError, as vLLM raises) instead of pydantic's raw text."""

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise FieldErrors(field_problems(exc)) from None


def field_problems(exc: ValidationError) -> list[str]:
    """One "field: problem, got value" line per pydantic error, without type codes or URLs."""
    lines = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        lines.append(f"{where}: {_problem(err)}" if where else _problem(err))
    return lines


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    head = f"{prefix}: " if prefix else ""
    return "\n".join(head + line for line in field_problems(exc))


def _problem(err: dict) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field (check its spelling)"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    msg = msg[:1].lower() + msg[1:]
    if kind == "value_error" and not err["loc"]:
        return msg  # whole-object checks already name their fields
    return f"{msg}, got {err['input']!r}"


def describe(exc: BaseException) -> str:
    """The text a user sees for an expected error (no traceback)."""
    if isinstance(exc, ValidationError):
        return format_validation_error(exc)
    return str(exc)


def read_json(path: str, what: str = "JSON"):
    """json.load that names the file, line and column of a syntax error."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}:{exc.colno}: not valid {what}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (expected UTF-8 {what})") from None
