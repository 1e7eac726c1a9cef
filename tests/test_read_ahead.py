"""Reading a stream ahead in a thread: it overlaps, stays bounded and loses nothing.

The references are the stream itself (the ids it yields, in order) and the thread each
item was read on. Events, not timings, show that an item was read before it was asked
for; the waits on them have generous timeouts that only a broken reader reaches.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import jax_adaptive as ja
from jax_adaptive import read_ahead
from jax_adaptive.read_ahead import ReadAhead, interrupts_deferred

WAIT = 10.0  # seconds: only a reader that does not read ahead waits this long


class Source:
    """An iterator of ids that records the reads: how many, on which thread, and when."""

    def __init__(self, n, fail_after=None):
        self.n, self.fail_after = n, fail_after
        self.reads, self.threads = 0, set()
        self.read = [threading.Event() for _ in range(n + 1)]  # read[i]: item i was read
        self.failed = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.threads.add(threading.get_ident())
        i = self.reads
        if self.fail_after is not None and i == self.fail_after:
            self.failed.set()
            raise OSError(f"the data server went away after {i} batches")
        if i >= self.n:
            raise StopIteration
        self.reads += 1
        self.read[i].set()
        return {"id": np.array([i])}


def test_items_come_in_order_read_on_another_thread_then_the_end():
    source = Source(6)
    reader = ReadAhead(source, depth=2)
    assert [int(item["id"][0]) for item in reader] == list(range(6))
    assert threading.get_ident() not in source.threads
    with pytest.raises(StopIteration):
        next(reader)


def test_the_next_items_are_read_while_the_consumer_works_but_no_more_than_depth():
    source = Source(100)
    reader = ReadAhead(source, depth=3)
    assert int(next(reader)["id"][0]) == 0
    # Not asked for yet: items 1 to 3 are read while this thread does something else.
    assert source.read[3].wait(WAIT)
    time.sleep(0.2)  # time enough for an unbounded reader to run far ahead
    assert source.reads == 1 + 3  # the one taken, and depth ahead
    reader.close()


def test_close_hands_back_what_was_read_and_the_stream_goes_on_after_it():
    source = Source(10)
    reader = ReadAhead(source, depth=2)
    taken = [int(next(reader)["id"][0]) for _ in range(3)]
    assert source.read[4].wait(WAIT)  # two read ahead
    unread = reader.close()
    rest = [int(item["id"][0]) for item in unread.items] + [int(x["id"][0]) for x in source]
    assert taken + rest == list(range(10))
    assert unread.error is None


def test_the_streams_error_comes_where_it_was_raised_after_the_items_before_it():
    reader = ReadAhead(Source(10, fail_after=4), depth=2)
    got = []
    with pytest.raises(OSError, match="after 4 batches"):
        for item in reader:
            got.append(int(item["id"][0]))
    assert got == [0, 1, 2, 3]


def test_a_rebatcher_closed_with_an_error_read_ahead_raises_it_to_the_streams_next_reader():
    source = Source(10, fail_after=5)  # ids 0..4, then the error
    with ja.Rebatcher(source, 2, read_ahead=8) as ahead:
        first = next(ahead)["id"].tolist()
        assert source.failed.wait(WAIT)  # the thread read up to the error
    assert first == [0, 1]
    again = ja.Rebatcher(source, 2)
    assert again.leftover == 3  # ids 2, 3, 4 were read ahead: not lost
    assert next(again)["id"].tolist() == [2, 3]
    with pytest.raises(OSError, match="after 5 batches"):
        next(again)  # id 4 waits for a second example; the error comes instead


@pytest.mark.parametrize("depth", [-1, 1.5, True, "2"])
def test_a_bad_read_ahead_is_refused_with_its_value(depth):
    with pytest.raises(ValueError, match=f"read_ahead={depth!r}"):
        ja.Rebatcher([np.zeros(2)], 2, read_ahead=depth)


def test_close_waits_for_a_read_in_progress_and_keeps_its_item():
    """Issue 37, fault 2: no thread of ours outlives `close`, and the read it waited for is
    handed back, not lost inside the thread."""
    started = threading.Event()

    def slow():
        yield 0
        started.set()
        time.sleep(0.3)  # the read in progress when `close` comes
        yield 1
        yield 2

    stream = slow()
    reader = ReadAhead(stream, depth=1)
    assert next(reader) == 0
    assert started.wait(WAIT)
    unread = reader.close()
    assert not reader._thread.is_alive()
    assert unread.items + list(stream) == [1, 2]


def test_a_signal_a_handler_of_the_users_raises_on_is_held_then_handled_once():
    """Issue 37, fault 1: any signal with a Python handler, not only the default Ctrl-C."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred() as held:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGALRM)
                time.sleep(0.01)  # its handler would run here: the block holds it
            assert calls == [] and held == [signal.SIGALRM] * 2
        assert calls == [signal.SIGALRM]  # one call, as the system merges a pending signal
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_ctrl_c_ends_a_wait_for_a_read_that_blocks_once_past_the_patience(monkeypatch):
    """A stream that never returns must not make Ctrl-C useless: past CLOSE_PATIENCE (0.2 s
    here) a Ctrl-C held while `close` waits ends the wait; the thread ends with its read."""
    monkeypatch.setattr(read_ahead, "CLOSE_PATIENCE", 0.2)
    reading, release = threading.Event(), threading.Event()

    def blocked():
        yield 0
        reading.set()
        release.wait(WAIT)  # a stalled worker
        yield 1

    reader = ReadAhead(blocked(), depth=1)
    assert next(reader) == 0 and reading.wait(WAIT)  # the read that blocks has begun
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():  # as fit's close is
            os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, held
            reader.close()  # waits 0.2 s, then gives up on the read
        waited = time.perf_counter() - start
        assert 0.2 <= waited < 0.2 + WAIT / 4, waited
        assert reader._thread.is_alive()  # still in the stream's __next__
    finally:
        release.set()
        reader._thread.join(WAIT)
    assert not reader._thread.is_alive()
