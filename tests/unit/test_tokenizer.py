"""Char tokenizer, tokenizer loading from folders, prompt rendering."""

import pytest

from megatron_rl.tokenizer import CharTokenizer, load_tokenizer, render_prompt


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode("12+7=19")
    assert len(ids) == 7 and min(ids) >= 3
    assert tok.decode(ids) == "12+7=19"
    assert tok.encode("1", add_special_tokens=True) == [1, tok.encode("1")[0]]
    assert tok.decode([1, *ids, 2], skip_special_tokens=True) == "12+7=19"
    assert tok.decode([*ids, 2]) == "12+7=19<eos>"
    assert tok.vocab_size == 3 + len(tok.chars) and all(c in tok.chars for c in "0123456789+-*=? ")
    with pytest.raises(ValueError, match="'\\\\t'"):
        tok.encode("a\tb")


def test_char_tokenizer_save_load_and_chat_template(tmp_path):
    tok = CharTokenizer("0123456789+=")
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, CharTokenizer) and loaded.vocab_size == 15
    assert loaded.encode("1+2=") == tok.encode("1+2=")
    msgs = [{"role": "user", "content": "1+2="}]
    assert render_prompt(loaded, msgs) == [1, *tok.encode("1+2=")]
    assert render_prompt(loaded, "1+2=") == [1, *tok.encode("1+2=")]


def test_folder_without_tokenizer_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    assert "tokenizer.json" in str(e.value) and "char_tokenizer.json" in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_hf_tokenizer_folder_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "user:", "assistant:", "hi", "there"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path))
    assert (
        "chat_template" in (tmp_path / "tokenizer_config.json").read_text()
        or (tmp_path / "chat_template.jinja").exists()
    )

    tok = load_tokenizer(str(tmp_path))
    ids = render_prompt(tok, [{"role": "user", "content": "hi there"}])
    # template -> "user: hi there assistant:" -> words user: hi there assistant: -> ids 2 4 5 3
    assert ids == [2, 4, 5, 3]
    assert render_prompt(tok, "hi there") == [vocab["hi"], vocab["there"]]
    with pytest.raises(ValueError, match="prompt must be"):
        render_prompt(tok, 3)
