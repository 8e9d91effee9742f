"""The hold feed (`wire.hold_feed`): a finished request's hold goes from the scheduler to the workers as the
request finishes, over a Unix socket in a directory only this user can enter; a reader opens nothing else."""

from __future__ import annotations

import os
import time

import pytest

from kvbridge.wire.hold_feed import HoldFeed, HoldFeedReader, HoldNote
from support.scheduler_sides import finished, producer

NOTE = HoldNote("r1", ((4, 5, 6),), "tok", "hash", 12.5)


def first_note(feed: HoldFeed, got: list, note: HoldNote = NOTE, within_s: float = 3.0) -> HoldNote:
    """Send `note` until the reader has one (a subscriber joins a moment after it connects)."""
    deadline = time.monotonic() + within_s
    while not got and time.monotonic() < deadline:
        feed.send(note)
        time.sleep(0.01)
    assert got, "no note reached the reader"
    return got[0]


def test_a_note_reaches_a_reader_as_sent():
    feed = HoldFeed()
    got: list = []
    reader = HoldFeedReader.open(feed.address, got.append)
    try:
        assert reader is not None
        assert first_note(feed, got) == NOTE
    finally:
        reader.close()
        feed.close()


def test_the_feed_directory_is_private_and_removed_at_close():
    feed = HoldFeed()
    directory = feed.directory
    assert os.stat(directory).st_mode & 0o777 == 0o700
    feed.close()
    assert not os.path.exists(directory)


def test_a_reader_refuses_a_feed_directory_others_can_enter():
    feed = HoldFeed()
    try:
        os.chmod(feed.directory, 0o711)
        assert HoldFeedReader.open(feed.address, print) is None
        os.chmod(feed.directory, 0o700)  # the control: the same feed, private again
        reader = HoldFeedReader.open(feed.address, print)
        assert reader is not None
        reader.close()
    finally:
        feed.close()


@pytest.mark.parametrize(
    "address",
    ["ipc:///nonexistent-kvbridge/holds", "tcp://127.0.0.1:5555", "ipc:///tmp/other-socket"],
    ids=["other-host", "not-ipc", "not-a-feed"],
)
def test_no_reader_for_an_address_that_is_not_a_feed_here(address):
    assert HoldFeedReader.open(address, print) is None


def test_a_finished_request_goes_to_the_feed_and_with_the_next_metadata():
    prefill = producer()
    got: list = []
    reader = HoldFeedReader.open(prefill.feed.address, got.append)
    try:
        first_note(prefill.feed, got, HoldNote("warm-up", (), "", "", 0.0))  # the reader has joined
        got.clear()
        delay, params = finished(prefill)
        deadline = time.monotonic() + 2
        while not any(n.request_id == "p1" for n in got) and time.monotonic() < deadline:
            time.sleep(0.005)
        meta = prefill.build_connector_meta()
        assert delay and meta.hold_feed == prefill.feed.address
        (hold,) = meta.holds
        got = [n for n in got if n.request_id == "p1"]  # a late warm-up note may have come after the clear
        assert got == [HoldNote(*hold)]
        assert (got[0].token, got[0].prompt_hash, got[0].groups) == (
            params["remote_token"],
            params["remote_prompt_hash"],
            ((7, 8),),
        )
    finally:
        reader.close()
        prefill.close()


def test_no_feed_when_turned_off_or_for_a_decode():
    prefill = producer(hold_feed=False)
    assert prefill.feed is None
    finished(prefill)
    meta = prefill.build_connector_meta()
    assert meta.hold_feed == "" and len(meta.holds) == 1  # the metadata alone brings the hold
    decode = producer(role="consumer")
    assert decode.feed is None and decode.build_connector_meta().hold_feed == ""


def test_a_reader_refuses_a_feed_directory_behind_a_symlink(tmp_path):
    feed = HoldFeed()
    try:
        link = tmp_path / "link"
        link.symlink_to(feed.directory)
        assert HoldFeedReader.open(f"ipc://{link}/holds", print) is None
    finally:
        feed.close()


def test_an_engine_starts_without_a_feed_when_none_can_be_bound(monkeypatch, caplog):
    """The feed is an accelerator: where no directory can be made, the metadata alone brings holds (a warning)."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError("read-only temp dir")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    prefill = producer()
    assert prefill.feed is None and "no hold feed" in caplog.text
