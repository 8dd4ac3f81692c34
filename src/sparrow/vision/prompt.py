"""Turn a question plus videos/images into a Prompt through the model's own processor.

    prompt = build_prompt(processor, "What moves?", videos=[read_video("clip.mp4", 8)])
    prompt.input_ids            # [n] with the visual placeholders already expanded by the processor
    prompt.model_inputs         # pixel_values_videos, video_grid_thw, second_per_grid_ts, mm_token_type_ids, ...
    visual_token_positions(prompt, model.config, "video")   # [m] indices of the video tokens in input_ids
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sparrow.errors import UserError
from sparrow.types import Prompt
from sparrow.vision.video import Video, check_num_frames, read_image, read_video

_DROPPED = ("input_ids", "attention_mask")  # batch 1, no padding: the model derives both


def supports_video(processor: Any) -> bool:
    return getattr(processor, "video_processor", None) is not None


def supports_images(processor: Any) -> bool:
    return getattr(processor, "image_processor", None) is not None


def build_prompt(processor: Any, question: str, videos: Sequence[Video] = (), images: Sequence[Any] = (),
                 chat: bool = True) -> Prompt:
    """One user turn [videos..., images..., question] rendered by the processor's chat template.

    Raises ValueError (naming `video` / `image` / `prompt`) if the processor cannot take the media.
    """
    if not question.strip():
        raise UserError("prompt must not be empty")
    if videos and not supports_video(processor):
        raise UserError(f"video: the model's processor ({type(processor).__name__}) has no video support")
    if images and not supports_images(processor):
        raise UserError(f"image: the model's processor ({type(processor).__name__}) has no image support")
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if (videos or images) and not template:
        raise UserError(f"video/image: the model's processor ({type(processor).__name__}) has no chat template, "
                         "so sparrow cannot place the visual tokens in the prompt")
    if chat and template:
        content = ([{"type": "video"}] * len(videos) + [{"type": "image"}] * len(images)
                   + [{"type": "text", "text": question}])
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False, chat_template=template)
    else:
        text = question
    kwargs: dict[str, Any] = {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["video_metadata"] = [v.metadata() for v in videos]
    if images:
        kwargs["images"] = list(images)
    features = processor(text=[text], return_tensors="pt", **kwargs)
    ids = features["input_ids"]
    assert ids.ndim == 2 and ids.shape[0] == 1, tuple(ids.shape)
    inputs = {k: v for k, v in features.items() if k not in _DROPPED}
    return Prompt(input_ids=ids[0].long(), model_inputs=inputs)


def visual_token_ids(config: Any, kind: str = "all") -> list[int]:
    """Placeholder token ids of `kind` ("image", "video" or "all") in a VLM's vocabulary."""
    if kind not in ("image", "video", "all"):
        raise UserError(f"kind must be 'image', 'video' or 'all', got {kind!r}")
    names = {"image": ("image_token_id", "image_token_index"), "video": ("video_token_id", "video_token_index")}
    ids = []
    for k in ("image", "video") if kind == "all" else (kind,):
        for name in names[k]:
            value = getattr(config, name, None)
            if value is not None:
                ids.append(int(value))
                break
    return ids


def visual_token_positions(prompt: Prompt, config: Any, kind: str = "all") -> Tensor:
    """[m] int64 indices into prompt.input_ids of the visual placeholder tokens (the tokens whose
    embeddings the vision tower replaces), ascending. `config` is the VLM's (top-level) config."""
    ids = torch.tensor(visual_token_ids(config, kind), dtype=prompt.input_ids.dtype)
    return torch.isin(prompt.input_ids, ids.to(prompt.input_ids.device)).nonzero().flatten()


DEFAULT_FRAMES = 8


def _images(image: Any) -> list[Any]:
    from PIL import Image

    items = image if isinstance(image, (list, tuple)) else [image]
    return [im.convert("RGB") if isinstance(im, Image.Image) else read_image(im) for im in items]


def _video(video: Any, frames: int | None) -> Video:
    if isinstance(video, Video):
        return video if frames is None else video.subsample(frames)
    if isinstance(video, np.ndarray):
        return Video.from_array(video, num_frames=frames)
    return read_video(video, DEFAULT_FRAMES if frames is None else frames)


def encode_media(processor: Any, question: Any, *, video: Any = None, frames: int | None = None,
                 image: Any = None, model_name: str = "the target") -> Prompt:
    """Validate the media arguments and build the prompt (see Pipeline.encode).

    video: a video file, a directory of frame images, a (T, H, W, 3) uint8 array or a Video;
    frames: how many frames to sample uniformly (default 8; all frames of an array/Video when None);
    image: an image file or PIL image, or a list of them.
    """
    if frames is not None:
        check_num_frames(frames)
        if video is None:
            raise UserError("frames: given without a video (pass video=... / --video)")
    if processor is None:
        what = "video" if video is not None else "image"
        raise UserError(f"{what}: {model_name} is a text-only model; a vision-language model (e.g. Qwen2.5-VL, "
                         "LLaVA-OneVision) is needed for video or image input")
    if not isinstance(question, str):
        raise UserError("prompt must be text when a video or image is given, not token ids")
    if video is not None and not supports_video(processor):
        raise UserError(f"video: {model_name}'s processor ({type(processor).__name__}) has no video support")
    if image is not None and not supports_images(processor):
        raise UserError(f"image: {model_name}'s processor ({type(processor).__name__}) has no image support")
    videos = [] if video is None else [_video(video, frames)]
    images = [] if image is None else _images(image)
    return build_prompt(processor, question, videos, images)
