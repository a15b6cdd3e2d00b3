"""The compile notice (``compiled/notice.py``): a line only when the user waits."""

import time

from specblock.compiled.notice import notice_if_slow


def test_a_slow_call_gets_a_line_before_and_after_and_a_fast_one_nothing(capsys):
    with notice_if_slow("compiling a thing", after=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "specblock: compiling a thing (first use; saved for later starts) ..."
    assert err[1].startswith("specblock: compiling a thing: done in ") and len(err) == 2
    with notice_if_slow("loading a thing", after=0.5):
        pass
    time.sleep(0.6)  # past the deadline: the cancelled timer must stay silent
    assert capsys.readouterr().err == ""
