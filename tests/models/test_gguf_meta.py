"""The config and tokenizer of a --quant gguf file built from the metadata sparrow's `read_gguf` read
(sparrow.models.gguf_native `_config_from_fields` / `_tokenizer_from_fields`) are the ones transformers builds from
the file (`AutoConfig` / `AutoTokenizer.from_pretrained(dir, gguf_file=...)`): the same config dict, the same
tokenizer class, the same saved tokenizer.json and the same ids on code, unicode, whitespace runs, special tokens
and a chat template. On tiny qwen2 / llama files (tied and untied, with and without BOS, a chat template) and,
with the presets installed, on qwen2.5-coder-0.5b / 1.5b. Through `_config_and_tokenizer`: the cache entry holds
them, and transformers' own reading takes over with one line where the fast path fails."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import tiny_tokenizer
from transformers import AutoConfig, AutoTokenizer

from sparrow.models import gguf_native
from sparrow.models.gguf_native import _config_and_tokenizer, _config_from_fields, _tokenizer_from_fields, read_gguf

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i * i)  # squares\r\n",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 東京 🚀 Grüße, ½ × π ≈ 1.57",
    "   leading spaces,\n\n\n   blank lines,    runs of    blanks   \t\t and trailing   ",
    "",
    " ",
    "x" * 300,
    "1234567890 3.14159 0x1F 1e-9",
]
CHAT_TEMPLATE = ("{% for m in messages %}<eos>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<eos>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def fib(n):  # 東京\n    ..."}]


SPM_PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in",
              "er", "re", "on", "\u2581d", "ef", "\u2581def", "\u2581f", "ox", "\u2581fox"]


def _shape(writer: gguf.GGUFWriter) -> None:
    """The tiny model's hyper-parameters, as both writers give them."""
    for add, value in ((writer.add_context_length, 1024), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_block_count, 2), (writer.add_head_count, 4),
                       (writer.add_head_count_kv, 2)):
        add(value)


def _finish(writer: gguf.GGUFWriter, vocab: int, tied: bool) -> None:
    """The embedding (and an output matrix unless `tied`), then the file written and closed."""
    rows = np.random.default_rng(0).standard_normal((vocab, 64)).astype(np.float32)
    writer.add_tensor("token_embd.weight", rows)
    if not tied:
        writer.add_tensor("output.weight", rows * 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def meta_file(path: Path, arch: str, *, tied: bool, bos: bool, chat_template: str | None, spm: bool = False) -> Path:
    """A GGUF whose metadata is a model's config and a byte-level BPE tokenizer (conftest.tiny_tokenizer, as
    llama.cpp's converter writes one: tokens, types with the special token CONTROL, merges), or with `spm` a
    sentencepiece one (tokenizer model "llama": pieces with scores, no merges, <unk> <s> </s>); its tensors: the
    embedding, and an output matrix unless `tied`."""
    if spm:
        return spm_file(path, tied=tied, chat_template=chat_template)
    tok = tiny_tokenizer()
    bpe = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda item: item[1])]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _shape(writer)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        writer.add_rope_dimension_count(16)
        writer.add_vocab_size(len(vocab))
    writer.add_file_type(7)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<eos>" else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.eos_token_id)
    if bos:
        writer.add_bos_token_id(tok.eos_token_id)
        writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    _finish(writer, len(vocab), tied)
    return path


def spm_file(path: Path, *, tied: bool, chat_template: str | None) -> Path:
    vocab = ["<unk>", "<s>", "</s>", *SPM_PIECES]
    writer = gguf.GGUFWriter(str(path), "llama")
    _shape(writer)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")  # no add_bos flag: llama.cpp's default (BOS added) applies
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0, 0.0, 0.0, *[-float(i) for i in range(len(SPM_PIECES))]])
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                            *[gguf.TokenType.NORMAL] * len(SPM_PIECES)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template.replace("<eos>", "</s>"))
    _finish(writer, len(vocab), tied)
    return path


def transformers_reads(path: Path) -> tuple[object, object]:
    return (AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name),
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


def config_dict(config: object) -> dict:
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def assert_same(config, tokenizer, ref_config, ref_tokenizer, tmp_path: Path, extra_texts: list[str] = (),
                saved: Path | None = None) -> None:
    """`saved`: the directory holding config / tokenizer as saved (the cache entry), else they are saved here."""
    assert config_dict(config) == config_dict(ref_config)
    assert type(tokenizer) is type(ref_tokenizer)
    for text in [*TEXTS, *extra_texts]:
        assert tokenizer(text)["input_ids"] == ref_tokenizer(text)["input_ids"], text
        ids = ref_tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == ref_tokenizer.decode(ids), text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, name) == getattr(ref_tokenizer, name), name
        assert getattr(tokenizer, f"{name}_id") == getattr(ref_tokenizer, f"{name}_id"), name
    assert tokenizer.all_special_tokens == ref_tokenizer.all_special_tokens
    assert tokenizer.chat_template == ref_tokenizer.chat_template
    if ref_tokenizer.chat_template is not None:
        for prompt in (True, False):
            assert (tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=prompt, tokenize=True)
                    == ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=prompt, tokenize=True))
    mine, ref = saved or tmp_path / "mine", tmp_path / "ref"
    for directory, conf, tok in ((ref, ref_config, ref_tokenizer), *[(mine, config, tokenizer)] * (saved is None)):
        conf.save_pretrained(directory)
        tok.save_pretrained(directory)
    assert {p.name for p in ref.iterdir()} <= {p.name for p in mine.iterdir()}
    for name in ("config.json", "tokenizer.json"):  # what the cache entry holds: byte for byte
        assert (mine / name).read_bytes() == (ref / name).read_bytes(), name
    bookkeeping = {"is_local", "local_files_only"}  # where from_pretrained found the file: not the tokenizer
    mine_conf, ref_conf = (json.loads((d / "tokenizer_config.json").read_text()) for d in (mine, ref))
    assert {k: v for k, v in mine_conf.items() if k not in bookkeeping} == \
        {k: v for k, v in ref_conf.items() if k not in bookkeeping}


@pytest.mark.parametrize(("arch", "tied", "bos", "template", "spm"), [
    ("qwen2", False, False, None, False), ("qwen2", True, True, CHAT_TEMPLATE, False),
    ("llama", False, True, CHAT_TEMPLATE, False), ("llama", True, False, None, False),
    ("llama", False, True, CHAT_TEMPLATE, True),
])
def test_config_and_tokenizer_from_the_fields_are_transformers(tmp_path, arch, tied, bos, template, spm):
    path = meta_file(tmp_path / f"tiny-{arch}.gguf", arch, tied=tied, bos=bos, chat_template=template, spm=spm)
    fields, tensors = read_gguf(path)
    config = _config_from_fields(fields, tensors)
    tokenizer = _tokenizer_from_fields(fields, config)
    assert config.model_type == arch and config.tie_word_embeddings is tied
    assert config.vocab_size == len(fields["tokenizer.ggml.tokens"])
    special = "</s>" if spm else "<eos>"
    assert tokenizer(f"{special}x")["input_ids"][-2] == tokenizer.convert_tokens_to_ids(special)
    if bos:
        assert tokenizer("the fox")["input_ids"][0] == tokenizer.bos_token_id
    assert_same(config, tokenizer, *transformers_reads(path), tmp_path,
                [f"{special}def add(a, b):{special}", "the fox in the den", " the  fox"])


def test_the_cache_entry_holds_them_and_transformers_reads_where_the_fast_path_fails(tmp_path, monkeypatch):
    path = meta_file(tmp_path / "tiny-qwen2.gguf", "qwen2", tied=True, bos=False, chat_template=CHAT_TEMPLATE)
    ref_config, ref_tokenizer = transformers_reads(path)
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    said: list[str] = []
    config, tokenizer = _config_and_tokenizer(path, said.append)  # fields read there
    assert not [line for line in said if "instead" in line], said
    entry = tmp_path / "cache" / "gguf-meta" / f"tiny-qwen2-{path.stat().st_size}"
    assert_same(config, tokenizer, ref_config, ref_tokenizer, tmp_path / "cached", saved=entry)

    def broken(fields, config):
        raise KeyError("tokenizer.ggml.tokens")

    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(gguf_native, "_tokenizer_from_fields", broken)
    said.clear()
    config, tokenizer = _config_and_tokenizer(path, said.append, *read_gguf(path))
    assert len([line for line in said if "transformers' reader instead" in line]) == 1, said
    assert "KeyError" in next(line for line in said if "instead" in line)
    entry = tmp_path / "cache2" / "gguf-meta" / f"tiny-qwen2-{path.stat().st_size}"
    assert_same(config, tokenizer, ref_config, ref_tokenizer, tmp_path / "fallback", saved=entry)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_preset_config_and_tokenizer_are_transformers(tmp_path, name):
    from sparrow.models.presets import PRESETS, gguf_path, is_installed

    if not is_installed(PRESETS[name]):
        pytest.skip(f"preset {name} not installed")
    path = gguf_path(PRESETS[name])
    fields, tensors = read_gguf(path)
    config = _config_from_fields(fields, tensors)
    tokenizer = _tokenizer_from_fields(fields, config)
    messages = [{"role": "system", "content": "You are Qwen, a coding assistant."},
                {"role": "user", "content": "Write `is_prime(n)` in Python.\n\n    # 東京 🚀  tabs\t\there"},
                {"role": "assistant", "content": "def is_prime(n):\n    return n > 1 and all(n % d for d in "
                                                 "range(2, int(n ** 0.5) + 1))"}]
    ref_config, ref_tokenizer = transformers_reads(path)
    specials = ["<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|>",
                "<|im_start|><|im_start|>  <|im_end|>x<|endoftext|>"]
    assert_same(config, tokenizer, ref_config, ref_tokenizer, tmp_path, specials)
    for prompt in (True, False):
        assert (tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
                == ref_tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True))
    assert tokenizer("<|im_start|>")["input_ids"] == [tokenizer.convert_tokens_to_ids("<|im_start|>")]


def test_a_vocabulary_read_gguf_could_not_decode_goes_to_transformers(tmp_path):
    path = meta_file(tmp_path / "tiny-qwen2.gguf", "qwen2", tied=True, bos=False, chat_template=None)
    fields, tensors = read_gguf(path)
    config = _config_from_fields(fields, tensors)
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[7] = "a\ufffd"  # what read_gguf makes of bytes that are not UTF-8 (transformers' reader raises)
    with pytest.raises(ValueError, match="not UTF-8"):
        _tokenizer_from_fields({**fields, "tokenizer.ggml.tokens": tokens}, config)
    with pytest.raises(ValueError, match="architecture"):
        _config_from_fields({**fields, "general.architecture": "gemma3"}, tensors)
