"""Tiny random models built from transformers configs (float32, CPU) and a tiny tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from sparrow.models import LoadedModel
from sparrow.runtime import hardware

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
] * 4
VOCAB = 320


def tiny_tokenizer(vocab_size: int = VOCAB, eos: str = "<eos>", corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `corpus` (another vocab_size / eos: a tokenizer of another model family)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def tiny_model(arch: str, seed: int, vocab_size: int = VOCAB, num_layers: int = 2) -> torch.nn.Module:
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(config)
    with torch.no_grad():  # sharper logits than the default init, so greedy text is not all ties
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model.float().eval()


def tiny_gemma3(num_layers: int = 6, seed: int = 0, sharpen: bool = True) -> torch.nn.Module:
    """Gemma-3 with sliding-window layers (window 8; with 6 layers: five sliding, one global)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              max_position_embeddings=1024)
    model = Gemma3ForCausalLM(config).float().eval()
    if sharpen:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def continuations(target: LoadedModel, prompts: list[str], new_tokens: int = 48) -> list[torch.Tensor]:
    """prompt + the target's own greedy continuation, as token ids (training data for draft heads)."""
    from sparrow.pipeline import Pipeline

    plain = Pipeline(target, None)
    new = [plain.generate_plain(p, max_new_tokens=new_tokens).token_ids for p in prompts]
    return [torch.cat([plain.encode(p).input_ids, torch.tensor(ids)]) for p, ids in zip(prompts, new)]


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy with Gaussian noise on every weight: a draft that agrees with the target often, not always."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return other


@pytest.fixture(scope="session", autouse=True)
def no_machine_measurement(tmp_path_factory):
    """`--dtype auto` and `--draft-quant auto` from the CPU flags alone, as on a fresh machine with the benchmark
    off: no test reads or writes this machine's cached micro-benchmark, whose choice differs between machines
    (one measured int4 drafts fastest, CI's w8a8, which a draft-equals-target test then sees as a weaker draft;
    a float32 model would run through oneDNN on one and not another). Environment variables, so subprocesses
    (the CLI run as a program) inherit them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPARROW_DTYPE_BENCHMARK", "0")
        patch.setenv("SPARROW_HARDWARE_CACHE", str(tmp_path_factory.mktemp("hardware-cache")))
        hardware.clear_cache()
        yield
    hardware.clear_cache()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def target_model(arch):
    return tiny_model(arch, seed=0)


@pytest.fixture(scope="session")
def loaded_target(target_model, tokenizer) -> LoadedModel:
    return LoadedModel(model=target_model, tokenizer=tokenizer, name="tiny")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared CPU two threads' spin waits cost 10-40x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
