"""Drafters propose tokens for the target to verify.

The interface is `base.Drafter`; names map to builders in `registry` (builders import their drafter
when first used, so importing this package loads only the interface, the registry and the two
light drafters re-exported below).
"""

from sparrow.drafters.base import Drafter
from sparrow.drafters.draft_model import DraftModelDrafter
from sparrow.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from sparrow.drafters.registry import REGISTRY, DrafterEntry, build_drafter, check_drafter_args, drafter_names

__all__ = ["Drafter", "REGISTRY", "DrafterEntry", "build_drafter", "check_drafter_args", "drafter_names",
           "DraftModelDrafter", "PromptLookupDrafter", "find_continuation"]
