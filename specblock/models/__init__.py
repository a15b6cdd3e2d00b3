"""Named target models: a registry of names and the builder that makes them on first use."""

from specblock.models.registry import (
    DEFAULT_TARGET_NAME,
    MODELS,
    ModelSpec,
    drafters_dir,
    is_built,
    model_dir,
    resolve_target,
    specblock_home,
)

__all__ = ["DEFAULT_TARGET_NAME", "MODELS", "ModelSpec", "drafters_dir", "is_built", "model_dir", "resolve_target",
           "specblock_home"]
