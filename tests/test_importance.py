"""A message's importance (`memory.build.importance`): what raises it, and what pins it."""

import pytest

from memory.build import importance


@pytest.mark.parametrize(
    "text",
    [
        "Remember that the door code is 5821.",
        "Don't forget: the door code is 5821.",
        "Note that the door code is 5821.",
        "For the record, the door code is 5821.",
        # "important:" is followed by a space, not a word: it must count all the same.
        "Important: the door code is 5821.",
        "IMPORTANT: the door code is 5821.",
    ],
)
def test_a_request_to_remember_a_detail_is_a_milestone(text: str) -> None:
    score = importance.score("user", text)
    assert importance.is_milestone(score), score


@pytest.mark.parametrize("ticket", ["OPS-4821", "#4821", "issue#4821"])
def test_an_identifier_weighs_more_than_a_number(ticket: str) -> None:
    # "#4821" after a space is an identifier as much as "OPS-4821" is.
    plain = importance.score("assistant", "Ticket 4821 is the one.")
    assert importance.score("assistant", f"Ticket {ticket} is the one.") > plain


def test_the_same_detail_said_in_passing_is_not() -> None:
    score = importance.score("user", "The door code is 5821.")
    assert not importance.is_milestone(score), score
