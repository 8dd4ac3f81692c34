"""Trained draft heads that read the target's hidden states (EAGLE-1/3) or KV cache: the modules and their
checkpoint layout; the seeds' variants: Dovetail's gated fusion and deeper heads (heads.fusion), LongSpec
(heads.longspec), Sparrow for Video-LLMs (heads.sparrow_head). Training lives in `sparrow.training`."""

from sparrow.heads.eagle import EagleHead, HeadConfig, TargetParts
from sparrow.heads.factory import new_head
from sparrow.heads.layout import default_head_dir, export_quantized, find_head, load_head, save_head

__all__ = ["EagleHead", "HeadConfig", "TargetParts", "default_head_dir", "export_quantized", "find_head", "load_head",
           "new_head", "save_head"]
