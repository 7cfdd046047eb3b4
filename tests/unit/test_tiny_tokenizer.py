"""The character tokenizer: one token per character, exact round trip, special ids set."""

from transformers import AutoTokenizer

from asyncrl.tiny import task
from asyncrl.tiny.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer, save_tokenizer

SAMPLES = ["17+5=\\boxed{22}", "a  b\nc", " leading and trailing ", "{}()[]<>|~`'\"", ""]


def test_round_trip_and_one_token_per_character():
    tokenizer = build_tokenizer()
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_and_small_vocab():
    tokenizer = build_tokenizer()
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) < 128
    assert tokenizer.encode(EOS_TOKEN) == [tokenizer.eos_token_id]
    ids = tokenizer.encode("1+1=") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+1="


def test_task_alphabet_is_in_the_vocabulary():
    tokenizer = build_tokenizer()
    for ch in task.task_alphabet(task.TinyTaskSpec(ops="+-*")):
        assert tokenizer.convert_tokens_to_ids(ch) != tokenizer.unk_token_id


def test_saved_tokenizer_loads_with_auto_tokenizer(tmp_path):
    save_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    original = build_tokenizer()
    for text in SAMPLES:
        assert loaded.encode(text) == original.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_token_id == original.eos_token_id
    assert loaded.pad_token_id == original.pad_token_id


def test_chat_template_is_the_identity_on_one_user_message():
    tokenizer = build_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+3="}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "12+3="
