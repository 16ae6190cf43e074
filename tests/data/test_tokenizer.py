"""Tokenisers: the byte-level one and a local Hugging Face tokenizer.json built offline here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lp_lightning.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_tokenizer_contract():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    assert tok.vocab_size <= 512  # fits the tiny DeepSeek-V3 config
    text = "naïve café\n日本語"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert np.array_equal(tok.encode_array(text), np.array(ids, dtype=np.uint8))
    assert [a.tolist() for a in tok.encode_many([text, ""])] == [ids, []]
    assert tok.decode([*ids, tok.eos_id]) == text  # EOS is skipped
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 -> replacement char
    assert tok.fingerprint == load_tokenizer("byte").fingerprint


def test_byte_tokenizer_decode_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 257\)"):
        ByteTokenizer().decode([257])


def test_hf_tokenizer_folder_roundtrip(tmp_path: Path, make_hf_tokenizer):
    folder = make_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_id == tok._backend.token_to_id("<|endoftext|>")
    assert tok.vocab_size == tok._backend.get_vocab_size(with_added_tokens=True) <= 400
    text = "def add(x, y):\n    return x + y\nnaïve café"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learnt
    assert max(ids) < tok.vocab_size and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids
    assert [a.tolist() for a in tok.encode_many([text, "fox"])] == [ids, tok.encode("fox")]
    # The tokenizer.json file path works too and yields the same mapping.
    assert load_tokenizer(str(folder / "tokenizer.json")).fingerprint == tok.fingerprint


def test_hf_fingerprint_is_stable_and_tracks_the_file(tmp_path: Path, make_hf_tokenizer):
    a = load_tokenizer(make_hf_tokenizer(tmp_path / "a"))
    assert load_tokenizer(tmp_path / "a").fingerprint == a.fingerprint
    assert a.fingerprint.startswith("hf-v1:") and a.fingerprint != "byte"
    data = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-5]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(data))
    assert load_tokenizer(tmp_path / "b").fingerprint != a.fingerprint


def test_hf_eos_from_config_and_argument(tmp_path: Path, make_hf_tokenizer):
    folder = make_hf_tokenizer(tmp_path / "tok", eos="<eot>", config_eos="<eot>")
    tok = load_tokenizer(folder)
    assert tok.eos_id == tok._backend.token_to_id("<eot>")
    assert load_tokenizer(folder, eos_token="a").eos_id == tok._backend.token_to_id("a")


def test_hf_missing_eos_raises(tmp_path: Path, make_hf_tokenizer):
    folder = make_hf_tokenizer(tmp_path / "tok", eos="<weird>")
    with pytest.raises(ValueError, match="no end-of-sequence token") as info:
        load_tokenizer(folder)
    assert "eos_token" in str(info.value)


def test_folder_without_tokenizer_json_names_path_and_expectation(tmp_path: Path):
    folder = tmp_path / "slow_tok"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(ValueError, match=r"no tokenizer\.json") as info:
        load_tokenizer(folder)
    assert str(folder) in str(info.value) and "tokenizer.model" in str(info.value)


def test_bad_specs(tmp_path: Path):
    with pytest.raises(ValueError, match="neither 'byte' nor an existing path"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="spec must be"):
        load_tokenizer(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eos_token"):
        load_tokenizer("byte", eos_token="</s>")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ValueError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path / "t.txt")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not parse"):
        load_tokenizer(tmp_path / "broken.json")
