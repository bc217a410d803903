"""fleet.enginesim.tokens: exact, deterministic token counts and filler output."""

from __future__ import annotations

import pytest

from fleet.enginesim import tokens


def test_repeated_words_give_exact_lengths():
    assert len(tokens.encode("hi " * 1000)) == 1000
    assert tokens.count_tokens("hi " * 1000) == 1000
    assert len(tokens.encode("word\n\tword  word")) == 3


def test_long_words_count_one_token_per_eight_characters():
    assert len(tokens.encode("abcdefgh")) == 1
    assert len(tokens.encode("abcdefghi")) == 2
    assert tokens.count_tokens("x" * 17) == 3


def test_equal_text_gives_equal_ids_and_token_id_prompts_pass_through():
    assert tokens.encode("the same prefix") == tokens.encode("the same prefix")
    assert tokens.encode_prompt([5, 6, 7]) == [5, 6, 7]
    assert tokens.encode_prompt(["one prompt"]) == tokens.encode("one prompt")


@pytest.mark.parametrize("bad", [["a", "b"], [[1], [2]], [1, 2.5], {"x": 1}, [tokens.VOCAB_SIZE]])
def test_batches_and_bad_prompts_are_refused(bad):
    with pytest.raises(tokens.PromptError):
        tokens.encode_prompt(bad)


def test_a_chat_is_role_marker_plus_content_per_message_plus_one():
    ids = tokens.encode_chat([{"role": "user", "content": "hi " * 10}])
    assert len(ids) == 12
    two = tokens.encode_chat([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
    ])
    assert len(two) == 1 + 2 + 1 + 2 + 1
    with pytest.raises(tokens.PromptError, match="role"):
        tokens.encode_chat([{"role": "wizard", "content": "x"}])


def test_filler_output_is_a_function_of_seed_and_prompt_and_round_trips():
    a = tokens.filler_token_ids(0, [1, 2, 3], 20)
    assert a == tokens.filler_token_ids(0, [1, 2, 3], 20)
    assert a != tokens.filler_token_ids(1, [1, 2, 3], 20)
    assert a != tokens.filler_token_ids(0, [1, 2, 4], 20)
    text = "".join(tokens.token_text(t) for t in a)
    assert tokens.encode(text) == a                    # a reply sent back re-encodes to the same ids


def test_eos_length_is_reproducible_with_the_requested_mean():
    n = [tokens.eos_length(0, [i], 50.0) for i in range(2000)]
    assert n == [tokens.eos_length(0, [i], 50.0) for i in range(2000)]
    assert 40 < sum(n) / len(n) < 60
    assert min(n) >= 1
