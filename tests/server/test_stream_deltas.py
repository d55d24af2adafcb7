"""Stream deltas: text that may still change is held back, and the pieces add up to the final text."""
from __future__ import annotations

from shuili.core.server.engine_loop import Snapshot
from shuili.core.server.openai_format import ChoiceStream


def snap(text: str, n: int, finished: bool = False, hidden: int = 0) -> Snapshot:
    return Snapshot(list(range(n)), [0.0] * n, [], text, finished, "stop" if finished else None, None, 3, hidden)


def test_a_partial_stop_string_is_held_back_until_it_resolves():
    s = ChoiceStream(["END"])
    assert s.advance(snap("ab E", 2)) == ("ab", 0, 2)  # the last len("END") - 1 characters wait
    assert s.advance(snap("ab EN", 3)) == (" ", 2, 3)
    assert s.advance(snap("ab ", 4, finished=True)) == ("", 3, 4)  # "EN" became the stop string


def test_a_partial_utf8_character_is_held_back():
    s = ChoiceStream([])
    assert s.advance(snap("caf\ufffd", 1))[0] == "caf"
    assert s.advance(snap("café", 2))[0] == "é"


def test_a_final_eos_token_is_not_sent():
    s = ChoiceStream([])
    s.advance(snap("hi", 2))
    assert s.advance(snap("hi", 3, finished=True, hidden=1)) == ("", 2, 2)


def test_pieces_add_up():
    s = ChoiceStream(["xyz", "q"])
    texts = ["a", "ab", "abx", "abxy", "abxyw", "abxywv"]
    out = "".join(s.advance(snap(t, i + 1))[0] for i, t in enumerate(texts))
    out += s.advance(snap("abxywv!", 7, finished=True))[0]
    assert out == "abxywv!"
