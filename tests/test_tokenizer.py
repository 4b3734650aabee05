"""The tokenizer reads special-token ids from tokenizer.json, the checkpoint's own or the bundled one."""

from __future__ import annotations

import json

from ds4serve.tokenizer import Tokenizer


def test_special_ids_come_from_the_file(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert tok.source == tiny_dir / "tokenizer.json"
    assert (tok.bos_id, tok.eos_id, tok.think_start_id, tok.think_end_id) == (0, 1, 128821, 128822)
    assert tok.vocab_size == 129280
    ids = tok.encode("<｜User｜>Hello<｜Assistant｜><think>")
    assert ids[0] == tok.user_id and ids[-2:] == [tok.assistant_id, tok.think_start_id]
    assert tok.decode(ids) == "<｜User｜>Hello<｜Assistant｜><think>"


def test_ids_follow_a_modified_file(tiny_dir, tmp_path):
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "</think>":
            entry["content"] = "</reasoning>"
        elif entry["content"] == "<｜place▁holder▁no▁5｜>":
            entry["content"] = "</think>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer(tmp_path).think_end_id == 128005


def test_falls_back_to_the_bundled_tokenizer(tmp_path):
    tok = Tokenizer(tmp_path)
    assert tok.source.name == "tokenizer.json" and tok.source.parent != tmp_path
    assert tok.bos_id == 0 and tok.user_id == 128803


def test_token_bytes_join_to_the_text_even_where_tokens_split_characters(tiny_dir):
    tok = Tokenizer(tiny_dir)
    for text in ("😀 x = '日本語 🎉 café'\n\tend", "<｜User｜>añb"):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    first, second = tok.encode("😀")  # the emoji's four bytes over two tokens, neither a character alone
    assert (tok.token_bytes(first), tok.token_bytes(second)) == (b"\xf0\x9f\x98", b"\x80")


def test_plain_encoding_spells_every_special_token_string_with_ordinary_tokens(tiny_dir):
    tok = Tokenizer(tiny_dir)
    added = json.loads(tok.source.read_text())["added_tokens"]
    control = {entry["id"] for entry in added}
    for entry in added:
        ids = tok.encode_plain(entry["content"])
        assert not control & set(ids) and tok.decode(ids) == entry["content"]
    text = "😀 x = '日本語 🎉 café'\n\tend  123456 <tool_result>"
    assert tok.encode_plain(text) == tok.encode(text)
