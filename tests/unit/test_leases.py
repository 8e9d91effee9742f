"""The prefill side's lease book (pure, clock passed in): claims pin, tokens guard, aborts free at once."""

from __future__ import annotations

from kvbridge.core.leases import MAX_EARLY, READ_MARGIN_S, LeaseBook, blocks_digest

BLOCKS = (1, 2, 3)
ORDER = blocks_digest(BLOCKS)  # what a reader's claim names: the published list, in its order


def held(book: LeaseBook, now: float = 0.0, token: str = "tok") -> LeaseBook:
    book.hold("r", now, token=token, prompt_hash="h", blocks=(BLOCKS,))
    return book


def test_an_unclaimed_request_expires_with_its_lease():
    book = held(LeaseBook(lease_s=10))
    assert book.due(9.9) == (set(), set())
    assert book.due(10.0) == (set(), {"r"})


def test_a_claim_pins_the_request_past_its_lease_until_the_read_deadline():
    book = held(LeaseBook(lease_s=10))
    assert book.claim("r", "tok", "h", ((1, 2),), "decode-a", read_s=30, now=9.0, order=ORDER) is None
    assert book.due(20.0) == (set(), set())  # the lease alone would have freed it at 10
    assert book.due(9.0 + 30 + READ_MARGIN_S - 0.01) == (set(), set())  # the reader's timeout, not the lease
    assert book.due(9.0 + 30 + READ_MARGIN_S) == (set(), {"r"})


def test_negative_control_without_a_claim_the_same_clock_frees_it():
    book = held(LeaseBook(lease_s=10))
    assert book.due(20.0) == (set(), {"r"})


def test_every_reader_notified_frees_it():
    book = held(LeaseBook(lease_s=10))
    for _ in range(2):  # both decode workers claim
        assert book.claim("r", "tok", "h", ((1,),), "d", 5, now=1.0, order=ORDER) is None
    assert book.notified("r", "tok", "d", "dp0/pp0/tp0", 2, now=2.0)
    assert book.due(2.0) == (set(), set())
    assert book.notified("r", "tok", "d", "dp0/pp0/tp0", 2, now=2.0)  # a repeat counts once
    assert book.due(2.0) == (set(), set())
    assert book.notified("r", "tok", "d", "dp0/pp0/tp1", 2, now=2.0)
    assert book.due(2.0) == ({"r"}, set())


def test_claims_notifications_and_aborts_need_the_token():
    book = held(LeaseBook(lease_s=10))
    assert book.claim("r", "wrong", "h", ((1,),), "d", 5, now=1.0) == "not_held"  # says nothing of the request
    assert book.claim("other", "tok", "h", ((1,),), "d", 5, now=1.0) == "not_held"
    assert not book.notified("r", "wrong", "d", "w", 1, now=1.0)
    assert not book.abort("r", "wrong", 1.0)
    assert book.due(5.0) == (set(), set())
    assert book.refused_total == 4
    assert book.abort("r", "tok", 1.0)
    assert book.due(5.0) == ({"r"}, set())
    assert book.aborted_total == 1


def test_a_claim_must_name_the_prompt_and_only_the_requests_blocks():
    book = held(LeaseBook(lease_s=10))
    assert book.claim("r", "tok", "other-prompt", ((1,),), "d", 5, now=1.0) == "mismatch"
    assert book.claim("r", "tok", "h", ((1, 9),), "d", 5, now=1.0, order=ORDER) == "mismatch"
    assert book.claim("r", "tok", "h", ((3,),), "d", 5, now=1.0, order=ORDER) is None


def test_a_claim_must_name_the_published_order_of_the_blocks():
    """Params whose block list was reordered, repeated or had a block replaced (possible without a deployment key
    to sign them) would load KV into the wrong positions: their digest is not the held list's."""
    for edited in ((3, 2, 1), (1, 1, 1), (1, 2, 2), (2, 3, 1), (1, 2), (1, 2, 3, 4), ()):
        book = held(LeaseBook(lease_s=10))
        assert book.claim("r", "tok", "h", ((1,),), "d", 5, now=1.0, order=blocks_digest(edited)) == "mismatch", edited
        assert book.claim("r", "tok", "h", ((1,),), "d", 5, now=1.0) == "mismatch"  # no digest at all
    assert held(LeaseBook(lease_s=10)).claim("r", "tok", "h", ((1,),), "d", 5, now=1.0, order=ORDER) is None


def test_negative_control_with_check_blocks_off_a_reordered_list_is_granted():
    book = held(LeaseBook(lease_s=10, check_blocks=False))
    assert book.claim("r", "tok", "h", ((1,),), "d", 5, now=1.0, order=blocks_digest((3, 2, 1))) is None
    assert (
        book.claim("r", "tok", "h", ((9,),), "d", 5, now=1.0, order=ORDER) == "mismatch"
    )  # the block set still counts


def test_the_digest_names_the_order_and_every_id():
    assert blocks_digest([1, 2, 3]) == blocks_digest((1, 2, 3)) != blocks_digest([3, 2, 1])
    assert blocks_digest([1 << 40]) != blocks_digest([0]) and len(blocks_digest([])) == 32


def test_a_second_engine_cannot_claim_or_complete_a_claimed_request():
    book = held(LeaseBook(lease_s=10))
    assert book.claim("r", "tok", "h", ((1,),), "d1", 5, now=1.0, order=ORDER) is None
    assert book.claim("r", "tok", "h", ((1,),), "d2", 5, now=1.0, order=ORDER) == "other_reader"
    assert not book.notified("r", "tok", "d2", "dp0/pp0/tp0", 1, now=1.0)
    assert book.due(2.0) == (set(), set())


def test_an_expired_request_cannot_be_claimed():
    book = held(LeaseBook(lease_s=10))
    assert book.claim("r", "tok", "h", ((1,),), "d", 5, now=10.0, order=ORDER) == "not_held"


def test_early_notifications_are_bounded_and_checked_when_the_hold_comes():
    book = LeaseBook(lease_s=10, early_ttl_s=1.0)
    assert book.notified("r", "tok", "d", "w", 1, now=0.0)
    assert book.notified("r2", "bad", "d", "w", 1, now=0.0)
    book.hold("r", 0.1, token="tok")
    book.hold("r2", 0.1, token="tok")
    assert book.due(0.2) == ({"r"}, set())  # r2's early note had the wrong token
    for i in range(MAX_EARLY + 10):
        book.notified(f"x{i}", "t", "d", "w", 1, now=1.0)
    assert len(book._early) == MAX_EARLY
    book.due(5.0)  # forgotten after early_ttl_s
    assert len(book._early) == 0


def test_with_a_token_check_only_key_holders_notifications_take_room_before_the_hold():
    """A full table of forged early notifications refused a key holder's (the flood of the transport-forgery
    attack). With `token_check` (a MAC of the request id under the deployment key) forged ones take no room and
    the key holder's is kept and applied at the hold; notifications without a token are refused either way.
    Negative control: without the check the flood fills the table and the key holder's is refused."""

    def check(request_id: str, token: str) -> bool:
        return token == f"mac-of-{request_id}"

    for checked in (True, False):
        book = LeaseBook(lease_s=10, max_early=8, token_check=check if checked else None)
        for i in range(100):
            book.notified(f"forged-{i}", "guess", "x", "w", 1, now=0.0)
        assert not book.notified("other", "", "d", "w", 1, now=0.0)
        taken = book.notified("r", "mac-of-r", "d", "w", 1, now=0.0)
        book.hold("r", 0.1, token="mac-of-r")
        assert taken is checked and (book.due(0.2) == ({"r"}, set())) is checked
        assert len(book._early) == (0 if checked else 8)


def test_freed_requests_are_remembered_until_held_again_and_bounded():
    book = LeaseBook(lease_s=10, max_freed=2)
    assert not book.freed("r", "tok")  # never held: a claim of it may wait for its hold
    held(book)
    assert not book.freed("r", "tok")
    assert book.abort("r", "tok", 1.0)
    assert book.freed("r", "tok")  # at the abort, before `due` frees it
    assert not book.freed("r", "guess")  # says nothing of the request to one without its token
    book.due(1.0)
    assert book.freed("r", "tok")
    held(book, now=2.0)  # held again
    assert not book.freed("r", "tok")
    assert book.due(12.0) == (set(), {"r"})
    assert book.freed("r", "tok")  # expired
    for request_id in ("a", "b"):
        book.hold(request_id, 20.0, token="tok", blocks=(BLOCKS,))
        assert book.notified(request_id, "tok", "d", "w", 1, now=20.0)
    assert book.due(20.0) == ({"a", "b"}, set())
    assert book.freed("a", "tok") and book.freed("b", "tok") and not book.freed("r", "tok")  # the oldest forgotten


def test_a_granted_read_goes_on_only_while_its_claim_stands():
    book = held(LeaseBook(lease_s=10))
    assert not book.still_reading("r", "tok", "decode-a", 1.0), "held, not claimed"
    assert book.claim("r", "tok", "h", ((1, 2),), "decode-a", read_s=30, now=1.0, order=ORDER) is None
    assert book.still_reading("r", "tok", "decode-a", 2.0)  # the control
    assert not book.still_reading("r", "tok!", "decode-a", 2.0)
    assert not book.still_reading("r", "tok", "decode-b", 2.0)
    assert not book.still_reading("r", "tok", "decode-a", 1.0 + 30 + READ_MARGIN_S)
    assert book.abort("r", "tok", 1.0)
    assert not book.still_reading("r", "tok", "decode-a", 2.0)


def test_an_abort_before_the_hold_frees_the_request_as_it_is_held():
    """The decode's abort of a request it will never read can come before the prefill worker holds it (the
    scheduler's feed was late, the metadata brings the hold a step later): kept, it frees the request at the hold
    instead of leaving its blocks to the lease. Negative controls: another token, or an abort forgotten after
    `early_ttl_s`, leaves the request held until its lease."""
    book = LeaseBook(lease_s=10, early_ttl_s=1.0)
    assert book.abort("r", "tok", 0.0)
    held(book, now=0.1)
    assert book.due(0.1) == ({"r"}, set())
    assert book.aborted_total == 1 and book.freed("r", "tok")
    assert not book.holds("r")

    wrong = LeaseBook(lease_s=10)
    assert wrong.abort("r", "guess", 0.0)  # kept: without a key any token may be the request's
    held(wrong, now=0.1)
    assert wrong.due(0.1) == (set(), set())
    assert wrong.due(10.1) == (set(), {"r"})

    late = LeaseBook(lease_s=10, early_ttl_s=1.0)
    assert late.abort("r", "tok", 0.0)
    late.due(2.0)  # forgotten
    held(late, now=2.0)
    assert late.due(2.0) == (set(), set())


def test_an_abort_of_a_request_freed_already_is_taken_and_counted_once():
    book = held(LeaseBook(lease_s=10))
    assert book.abort("r", "tok", 1.0)
    assert book.abort("r", "tok", 1.5)  # a repeat: nothing left to free
    assert book.due(2.0) == ({"r"}, set())
    assert book.abort("r", "tok", 2.5)
    assert book.aborted_total == 1
    assert book.due(3.0) == (set(), set())


def test_with_a_token_check_only_key_holders_aborts_are_kept_before_the_hold():
    def check(request_id: str, token: str) -> bool:
        return token == f"mac-of-{request_id}"

    book = LeaseBook(lease_s=10, max_early=4, token_check=check)
    for i in range(50):
        assert not book.abort(f"forged-{i}", "guess", 0.0)
    assert not book.abort("r", "", 0.0)
    assert book.abort("r", "mac-of-r", 0.0)
    book.hold("r", 0.1, token="mac-of-r")
    assert book.due(0.1) == ({"r"}, set())
    assert len(book._early) == len(book._early_aborts) == 0


def test_early_aborts_are_kept_once_apart_from_notifications_and_from_their_latest():
    """A repeated abort takes no more room; a table full of early aborts refuses no early notification; an abort
    is kept early_ttl_s from the latest one, not from an earlier notification of the same id. And an abort with
    another token of the same id (a key holder's token of an earlier run: another salt) frees nothing."""
    book = LeaseBook(lease_s=10, max_early=2, early_notes_per_request=2, early_ttl_s=1.0)
    for _ in range(5):
        assert book.abort("r", "tok", 0.0)
    assert book.abort("a", "t", 0.0) and not book.abort("b", "t", 0.0)  # the abort table is full (2)
    assert book.notified("n", "tok", "d", "w", 1, now=0.0)  # notifications have their own room
    assert book.notified("r", "tok", "d", "w", 1, now=0.0)
    assert book.abort("r", "tok", 0.9)  # refreshed
    book.due(1.5)  # the notifications and "a" are forgotten; "r"'s abort is 0.6 s old
    held(book, now=1.5)
    assert book.due(1.5) == ({"r"}, set())

    other = LeaseBook(lease_s=10)
    assert other.abort("r", "token-of-an-earlier-run", 0.0)
    held(other, now=0.1)
    assert other.due(0.1) == (set(), set())
