"""Finding records removed from the log before a fold applied them (spark/gaps.py): a jump of
more than one transaction marker asks the broker where the log starts now; only a log that
starts after the fold's progress is a loss."""

from __future__ import annotations

from spark.gaps import Gaps, skipped


class Broker(Gaps):
    def __init__(self, starts: dict[str, int]) -> None:
        super().__init__("unused:9092")
        self.starts, self.asked = starts, 0

    def _log_starts(self, keys: list[str]) -> dict[str, int]:
        self.asked += 1
        return {k: self.starts.get(k, 0) for k in keys}


def test_the_next_record_or_one_after_a_transaction_marker_is_no_gap() -> None:
    broker = Broker({"t:0": 100})
    assert broker.lost({"t:0": 9}, {"t:0": 10}) == {}
    assert broker.lost({"t:0": 9}, {"t:0": 11}) == {}
    assert broker.lost({}, {"t:0": 0}) == {} and broker.lost({}, {"t:0": 1}) == {}
    assert broker.asked == 0  # a healthy batch costs no request


def test_a_longer_jump_is_a_loss_only_when_the_log_now_starts_after_the_progress() -> None:
    broker = Broker({"t:0": 0, "t:1": 50})
    # An aborted transaction (or compaction) in t:0: the log still starts at 0.
    assert broker.lost({"t:0": 9, "t:1": 9}, {"t:0": 20}) == {}
    # t:1's records 10..49 were deleted before the fold applied them.
    assert broker.lost({"t:0": 9, "t:1": 9}, {"t:0": 20, "t:1": 50}) == {"t:1": (10, 50)}
    # Never applied anything, and the log starts at 7: 0..6 are gone.
    assert Broker({"t:2": 7}).lost({}, {"t:2": 7}) == {"t:2": (0, 7)}


def test_in_a_changelog_any_offset_skipped_past_the_progress_was_removed_unread() -> None:
    # One offset a record (CDC writes no transactions): the next offset, or nothing was lost.
    assert skipped({"c:0": 9}, {"c:0": 10}) == {}
    assert skipped({"c:0": 9, "d:0": 4}, {"c:0": 11, "d:0": 5}) == {"c:0": (10, 11)}
    # Read from its start (no progress there): what it reads is all there is, as for a rebuild.
    assert skipped({}, {"c:0": 7}) == {}
