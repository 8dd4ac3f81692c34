"""Tiny random Video-LLMs (Qwen2.5-VL, LLaVA-OneVision) with real processors, and synthetic videos.

Everything is built offline from configs (float32, ~0.2 M parameters, byte-level tokenizer) and saved
with `save_pretrained`, so tests load it back through `sparrow.models.load_model(directory)` exactly
like a downloaded checkpoint. See /work/shared/reference/VLM_TESTING.md for why each field is set.

    save_tiny_vlm("qwen2.5-vl", tmp_path / "qwen", seed=0)   # -> directory loadable by load_model
    frames = moving_squares(8, 64, 64)                       # (T, H, W, 3) uint8
    write_mp4(tmp_path / "v.mp4", frames, fps=4.0); write_frame_dir(tmp_path / "frames", frames)
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

KINDS = ("qwen2.5-vl", "llava-onevision")

QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_OV_TEMPLATE = QWEN_VL_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<image>\n").replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]
INIT = {"qwen2.5-vl": 0.1, "llava-onevision": 0.15}
"""Text-weight init: varied greedy text that still repeats itself (so prompt lookup gets accepted drafts),
with top-1/top-2 margins (~1e-2) far above the K-at-once verification error (~1e-5)."""


def byte_tokenizer():
    """266-token byte-level Qwen2 tokenizer with Qwen's and LLaVA's vision tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
        "<|video_pad|>", "<image>", "<video>"]})
    return tok


def _text(tok, init: float, num_layers: int) -> dict:
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                initializer_range=init, bos_token_id=None, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def tiny_vlm(kind: str, tok, seed: int, init: float | None = None, num_layers: int = 2) -> torch.nn.Module:
    """A random float32 model of `kind` whose special token ids match `tok`."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    ids = tok.convert_tokens_to_ids
    init = INIT.get(kind, 0.1) if init is None else init
    torch.manual_seed(seed)  # tests only: model construction draws from the global generator
    if kind == "qwen2.5-vl":
        text = _text(tok, init, num_layers) | {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                               fullatt_block_indexes=[1], tokens_per_second=2),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
        model = Qwen2_5_VLForConditionalGeneration(config)
    elif kind == "llava-onevision":
        config = LlavaOnevisionConfig(
            vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=32, patch_size=8,
                                             vision_use_head=False),
            text_config=Qwen2Config(**_text(tok, init, num_layers)),
            image_token_index=ids("<image>"), video_token_index=ids("<video>"),
            vision_feature_select_strategy="full", vision_feature_layer=-1, image_grid_pinpoints=PINPOINTS)
        model = LlavaOnevisionForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown tiny VLM kind {kind!r}; expected one of {KINDS}")
    with torch.no_grad():  # logit 0 for EOS never wins against ~266 random logits: generations run to the end
        model.get_output_embeddings().weight[tok.eos_token_id] = 0.0
    model.generation_config.eos_token_id = None
    return model.float().eval()


def tiny_processor(kind: str, tok):
    if kind == "qwen2.5-vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}),
            video_processor=Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56},
                                                  cap_pixels_per_frame=True),
            tokenizer=tok, chat_template=QWEN_VL_TEMPLATE)
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": 32, "width": 32},
                                                     image_grid_pinpoints=PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32}),
        tokenizer=tok, num_image_tokens=(32 // 8) ** 2, vision_feature_select_strategy="full",
        chat_template=LLAVA_OV_TEMPLATE)


def save_tiny_vlm(kind: str, directory: Path, seed: int = 0, init: float | None = None,
                  model: torch.nn.Module | None = None) -> Path:
    """Write a tiny VLM (or `model`) plus its processor into `directory`; returns it."""
    tok = byte_tokenizer()
    model = tiny_vlm(kind, tok, seed, init) if model is None else model
    model.save_pretrained(directory)
    tiny_processor(kind, tok).save_pretrained(directory)
    return Path(directory)


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy with Gaussian noise on the language model's weights: a draft that agrees often, not always."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "language_model" in name or "lm_head" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return other


def moving_squares(num_frames: int = 8, height: int = 64, width: int = 64) -> np.ndarray:
    """(T, H, W, 3) uint8: a red and a green square moving in opposite directions on grey."""
    frames = np.full((num_frames, height, width, 3), 40, np.uint8)
    s = max(4, height // 6)
    for t in range(num_frames):
        x, y = (3 * t) % (width - s), (2 * t) % (height - s)
        frames[t, y:y + s, x:x + s] = (220, 30, 30)
        frames[t, height - s - y:height - y, width - s - x:width - x] = (30, 200, 60)
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: float = 4.0) -> Path:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return Path(path)


def write_frame_dir(directory: Path, frames: np.ndarray) -> Path:
    from PIL import Image

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(directory / f"frame_{i:04d}.png")
    return directory
