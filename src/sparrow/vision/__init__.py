"""Video-LLM support: video/image reading, processor inputs -> Prompt, and the VLM CachedModel subclasses."""

from sparrow.runtime.vision import (
                                   MRopeCachedModel,
                                   VisionCachedModel,
                                   cached_model_class,
                                   has_mrope,
                                   is_vlm,
                                   mrope_positions,
)
from sparrow.vision.prompt import (
                                   build_prompt,
                                   supports_images,
                                   supports_video,
                                   visual_token_ids,
                                   visual_token_positions,
)
from sparrow.vision.video import FRAME_DIR_FPS, Video, read_image, read_video, sample_indices

__all__ = ["FRAME_DIR_FPS", "MRopeCachedModel", "Video", "VisionCachedModel", "build_prompt", "cached_model_class",
           "has_mrope", "is_vlm", "mrope_positions", "read_image", "read_video", "sample_indices",
           "supports_images", "supports_video", "visual_token_ids", "visual_token_positions"]
