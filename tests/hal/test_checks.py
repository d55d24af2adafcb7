"""`inputs_checked` marks a block, and only that block, in only the thread that entered it."""
import threading

import pytest

from shuili.hal.checks import inputs_are_checked, inputs_checked


def test_the_flag_holds_inside_the_block_only():
    assert not inputs_are_checked()
    with inputs_checked():
        assert inputs_are_checked()
        with inputs_checked():
            assert inputs_are_checked()
        assert inputs_are_checked()
    assert not inputs_are_checked()


def test_an_error_in_the_block_clears_the_flag():
    with pytest.raises(RuntimeError), inputs_checked():
        raise RuntimeError("step failed")
    assert not inputs_are_checked()


def test_another_thread_keeps_its_checks():
    seen = []
    with inputs_checked():
        t = threading.Thread(target=lambda: seen.append(inputs_are_checked()))
        t.start()
        t.join()
    assert seen == [False]
