"""Everything that trains or tunes: head training (corpus, features, trainer, plots) and layer-skip tuning."""

from sparrow.training.heads import TrainReport, extract_features, train_head

__all__ = ["TrainReport", "extract_features", "train_head"]
