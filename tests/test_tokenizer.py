"""The tokenizer asset and the chat template: exact round trips, the promised ids, the format."""

import hashlib

import pytest

from snapshots import chat
from snapshots import tokenizer as tk

CODE = (
    'def grüße(name: str) -> str:\n\t"""Say hello — to 世界 🐍."""\r\n'
    "    return f'Hallo {name}!'  # naïve café\n\n\n    \n"
    "x = '<|end|>' + \"<|assistant|>\"  # special-token strings inside code\n"
    "\x00\x7f\u200b\ufeff end"
)


def test_round_trip_is_exact_on_code_with_unicode():
    ids = tk.encode(CODE)
    assert tk.decode(ids) == CODE
    assert all(0 <= i < tk.VOCAB_SIZE for i in ids)


def test_special_token_strings_in_text_are_not_special():
    ids = tk.encode("a <|end|> b <|bos|>")
    assert not set(ids) & set(tk.SPECIAL_TOKENS.values())


def test_special_ids_and_vocab_size_are_as_specified():
    tok = tk.load_tokenizer()
    expected = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|tool_call|>", "<|tool_result|>", "<|end|>"]
    assert [tok.id_to_token(i) for i in range(9)] == expected
    assert (tk.PAD_ID, tk.BOS_ID, tk.EOS_ID, tk.END_ID) == (0, 1, 2, 8)
    assert tok.get_vocab_size() == 4096


def test_bpe_compresses_python():
    text = "import os\n\ndef main():\n    for path in os.listdir('.'):\n        print(path)\n"
    assert len(tk.encode(text)) < len(text.encode()) / 2.5


def test_hash_is_sha256_of_file_and_asset_is_small():
    assert tk.tokenizer_hash() == hashlib.sha256(tk.DEFAULT_PATH.read_bytes()).hexdigest()
    assert tk.DEFAULT_PATH.stat().st_size < 1_000_000


def test_missing_asset_is_a_clear_error(tmp_path):
    with pytest.raises(tk.TokenizerAssetError, match="not found"):
        tk.load_tokenizer(tmp_path / "nope.json")


MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix café.py"},
    {"role": "assistant", "content": "Let me read it."},
    {"role": "tool_call", "content": chat.tool_call_content("Read", {"file_path": "café.py"})},
    {"role": "tool_result", "content": CODE},
]


def test_template_wraps_each_message_and_ends_with_assistant():
    ids = chat.render(MESSAGES)
    expected = [tk.BOS_ID]
    for m in MESSAGES:
        expected += [chat.ROLE_IDS[m["role"]], *tk.encode(m["content"]), tk.END_ID]
    expected.append(tk.ASSISTANT_ID)
    assert ids == expected
    assert ids[0] == tk.BOS_ID and ids[-1] == tk.ASSISTANT_ID
    assert chat.rendered_length(len(tk.encode(m["content"])) for m in MESSAGES) == len(ids)


def test_prefix_renders_to_prefix_and_text_form_matches_ids():
    full = chat.render(MESSAGES)
    part = chat.render(MESSAGES[:3], generation_prompt=False)
    assert full[: len(part)] == part
    assert tk.decode(chat.render(MESSAGES)) == chat.render_text(MESSAGES).replace("<|end|>\n", "<|end|>")
    assert chat.render_text(MESSAGES[:1]) == "<|bos|><|system|>You are a coding agent.<|end|>\n<|assistant|>"


def test_tool_call_content_format():
    assert chat.tool_call_content("Grep", {"pattern": "x", "-n": True}) == 'Grep({"pattern": "x", "-n": true})'


@pytest.mark.parametrize("bad", [{"role": "robot", "content": "x"}, {"role": "user", "content": 3}, "text"])
def test_template_refuses_bad_messages(bad):
    with pytest.raises(chat.MessageError, match="message 1"):
        chat.render([{"role": "user", "content": "ok"}, bad])
