"""`sparrow serve` in a real process over conftest's tiny float32 llama (draft-model drafter on a perturbed copy, as
in test_serve.py), whose every round sleeps ROUND_SECONDS per request, so that requests are still running when a
test signals the process. `python tests/serve/slow_server.py [sparrow serve flags...]` with tests/ on PYTHONPATH."""

from __future__ import annotations

import sys
import time

import torch
from conftest import perturbed, tiny_model, tiny_tokenizer

import sparrow
from sparrow.cli import app
from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline

ROUND_SECONDS = 0.03


class SlowPipeline(Pipeline):
    def sequence(self, prompt, *, on_text=None, **options):  # what the server's batches run
        def slow(text: str):
            time.sleep(ROUND_SECONDS)
            return on_text(text)

        return super().sequence(prompt, on_text=slow if on_text is not None else None, **options)


def tiny_pipeline(pipeline: type[Pipeline] = Pipeline) -> Pipeline:
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.3, seed=1), tokenizer=target.tokenizer, name="draft")
    return pipeline(target, build_drafter("draft-model", target, draft, 4))


def load(*args, **kwargs) -> Pipeline:
    return tiny_pipeline(SlowPipeline)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sparrow.load = load  # what `sparrow serve` calls to load its pipeline
    app(["serve", "--target", "tiny", *sys.argv[1:]], prog_name="sparrow")
