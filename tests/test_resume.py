"""Where a migrated stream resumes (pdserve/controller/resume.py): the tokens whose whole text
the client has, as vLLM's detokenizer sends it (late for part of a character, and the last
characters held back while they could begin a stop string)."""

from __future__ import annotations

from vllm import SamplingParams

from pdserve.controller.resume import Resume, holdback


def test_each_token_that_brought_text_is_a_point():
    r = Resume()
    r.add(1, " a")
    r.add(1, " b")
    assert r.point() == (2, 4)


def test_a_token_whose_text_comes_later_is_not_a_point():
    r = Resume()
    r.add(1, " a")
    r.add(1, "")  # the first byte of a character
    assert r.point() == (1, 2)
    r.add(1, "é")  # the character's last byte: both tokens' text
    assert r.point() == (3, 3)


def test_a_delta_of_several_tokens_is_not_a_point():
    # Outputs merged while their reader was busy: the last tokens may be part of a character
    # whose text has not come.
    r = Resume()
    r.add(1, " a")
    r.add(3, " b c")
    assert r.point() == (1, 2)
    r.add(1, " d")
    assert r.point() == (5, 8)


def sent(texts: list[str], held: int) -> list[str]:
    """What vLLM's detokenizer sends a stream after each token of these texts, holding the
    last `held` characters back."""
    out, full, done = [], "", 0
    for t in texts:
        full += t
        upto = max(done, len(full) - held)
        out.append(full[done:upto])
        done = upto
    return out


def test_stop_string_hold_back_moves_the_point_back_to_text_the_client_has():
    # A stop string of 4 characters: the client has "", "a", "abc", "abcde" after each token.
    r = Resume(holdback=3)
    deltas = sent(["ab", "cd", "ef", "gh"], held=3)
    for delta, point in zip(deltas, [(0, 0), (0, 0), (0, 0), (2, 4)]):
        r.add(1, delta)
        assert r.point() == point  # "abcd" is the text of the first two tokens
    assert r.tokens == 4 and r.text_len == 5


def test_the_points_kept_are_bounded_by_the_hold_back():
    r = Resume(holdback=3)
    for delta in sent(["xy"] * 1000, held=3):
        r.add(1, delta)
    assert r.point() == (998, 1996)  # the client has 1,997 characters of 2,000
    assert len(r._marks) <= 3  # the point and the tokens after it that brought text


def test_holdback_is_vllms():
    assert holdback(SamplingParams(stop=["end", "x"])) == 2
    assert holdback(SamplingParams(stop=["end"], include_stop_str_in_output=True)) == 0
    assert holdback(SamplingParams()) == 0
