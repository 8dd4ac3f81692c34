"""Everything that trains or tunes: head training (corpus, features, trainer, the GPU recipe, plots) and layer-skip
tuning."""
