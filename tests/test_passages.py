"""How a message is cut into passages (`memory.build.passages.split`)."""

from memory.build import passages


def test_sentences_of_three_words_or_more_are_passages() -> None:
    text = (
        "Hey Jo! Crazy thing happened - I was in the final of a big tournament. "
        "We lost in the end.\nStill proud of the team though… See you?"
    )
    assert passages.split(text) == [
        "Crazy thing happened - I was in the final of a big tournament.",
        "We lost in the end.",
        "Still proud of the team though…",
    ]


def test_a_message_of_one_sentence_has_none() -> None:
    assert passages.split("Hello there! I finally finished the report today.") == []
    assert passages.split("") == []


def test_a_long_message_is_grouped_into_at_most_max_passages() -> None:
    sentences = [f"This is sentence number {i} of the document." for i in range(40)]
    found = passages.split(" ".join(sentences))
    assert len(found) <= passages.MAX_PASSAGES
    assert " ".join(found) == " ".join(sentences)
