"""A Video-LLM proxy for CPU measurements: Qwen2.5-VL whose language model is the real qwen2.5-coder-1.5b and
whose vision tower is random. Label every number measured on it "real language model, random vision tower".

No trained VLM ships on any registry reachable here. Qwen2.5-VL's language model is a Qwen2 decoder with
M-RoPE; qwen2.5-coder-1.5b has the same layer shapes and head size 128, so its weights load unchanged into
`Qwen2_5_VLForConditionalGeneration` (`mrope_section` [16, 24, 24], as in the released models). On text alone
the three M-RoPE components coincide and the proxy decodes exactly like the preset (checked below). The vision
tower has Qwen2.5-VL's widths (1280 hidden, 16 heads, patch 14, 2x2 merge, window attention) but only
`--vision-depth` blocks, initialised from a seeded generator, and the merger's output is rescaled so a visual
token's embedding has `--visual-scale` times the RMS of a text token's: inputs that carry no learned meaning.
At 1.0 the language model answered vtest.avi with degenerate repetition ("IPIOPIO...", 8 frames) or unrelated
Chinese prose (32 frames); at 0.1 it wrote English about "the video" at 8 frames (default; 0.03 gave repetition
again), so the decoded text, and what drafters can predict of it, is closer to a VLM's. Decoding cost (what speculative
decoding changes) depends on the language model and
on the number of visual tokens, not on what the tower learned.

    python benchmarks/vlm_proxy.py --out ~/.cache/sparrow/proxy/qwen2.5-vl-coder-1.5b
    sparrow generate "Describe the video." --model ~/.cache/sparrow/proxy/qwen2.5-vl-coder-1.5b \
        --video /usr/share/doc/opencv-doc/examples/data/vtest.avi --frames 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparrow.models import load_model

TEMPLATE = (  # Qwen2.5-VL's chat layout: a default system turn, visual placeholders inside user turns
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def proxy_config(text_config: dict, tokenizer, vision_depth: int):
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    text = {k: v for k, v in text_config.items() if k not in ("architectures", "model_type", "_model_name_or_path")}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    if head_dim != 128:
        raise SystemExit(f"M-RoPE section [16, 24, 24] needs head size 128; this language model has {head_dim}")
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[16, 24, 24])
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    vision = dict(depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                  out_hidden_size=text["hidden_size"], patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                  window_size=112, fullatt_block_indexes=[vision_depth - 1], tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


@torch.no_grad()
def randomise_vision(visual: torch.nn.Module, generator: torch.Generator, target_rms: float) -> float:
    """Seeded init of the tower (normal 0.02 weights, zero biases, unit norms); the merger's last linear layer is
    scaled so visual embeddings have RMS `target_rms`. Returns that scale."""
    for name, p in visual.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    grid = torch.tensor([[2, 8, 8]])  # one 2-frame patch group of 8 x 8 patches
    pixels = torch.rand(2 * 8 * 8, 3 * 2 * 14 * 14, generator=generator)
    out = visual(pixels.to(visual.dtype), grid_thw=grid)
    out = getattr(out, "pooler_output", out)
    rms = out.float().pow(2).mean().sqrt().item()
    last = [m for m in visual.merger.modules() if isinstance(m, torch.nn.Linear)][-1]
    scale = target_rms / rms
    last.weight.mul_(scale)
    last.bias.mul_(scale)
    return scale


def build(out: Path, base: str, vision_depth: int, seed: int, visual_scale: float) -> Path:
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    lm = load_model(base, dtype="float32", progress=False)
    tok = lm.tokenizer
    config = proxy_config(lm.model.config.to_dict(), tok, vision_depth)
    model = Qwen2_5_VLForConditionalGeneration(config).float().eval()  # its random init is overwritten below
    model.model.language_model.load_state_dict(lm.model.model.state_dict())
    model.lm_head.load_state_dict(lm.model.lm_head.state_dict())
    text_rms = lm.model.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
    scale = randomise_vision(model.model.visual, torch.Generator().manual_seed(seed), visual_scale * text_rms)
    model.generation_config.eos_token_id = lm.model.generation_config.eos_token_id
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    pixels = 224 * 224  # per frame: 64 frames of a 4:3 video -> ~2k visual tokens
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448}),
        video_processor=Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": pixels},
                                              cap_pixels_per_frame=True),
        tokenizer=tok, chat_template=TEMPLATE).save_pretrained(out)
    (out / "PROXY.json").write_text(json.dumps({
        "what": "real language model, random vision tower", "language_model": base, "vision_depth": vision_depth,
        "vision_seed": seed, "visual_scale": visual_scale, "merger_scale": scale, "text_embedding_rms": text_rms,
        "max_pixels_per_frame": pixels}, indent=2))
    return out


@torch.no_grad()
def check_text(out: Path, base: str, tokens: int = 16) -> None:
    """The proxy's greedy continuation of a text prompt equals the base model's (both bfloat16, the proxy's
    stored dtype)."""
    from sparrow.pipeline import Pipeline

    prompt = "def fibonacci(n):"
    a = Pipeline(load_model(base, dtype="bfloat16", progress=False), None).generate_plain(prompt, max_new_tokens=tokens)
    b = Pipeline(load_model(str(out), dtype="bfloat16", progress=False), None).generate_plain(prompt,
                                                                                          max_new_tokens=tokens)
    if a.token_ids != b.token_ids:
        raise SystemExit(f"proxy text decoding differs from {base}: {a.text!r} vs {b.text!r}")
    print(f"text check: proxy == {base} on {tokens} greedy tokens ({b.text!r})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path.home() / ".cache" / "sparrow" / "proxy" / "qwen2.5-vl-coder-1.5b"
    )
    parser.add_argument("--base", default="qwen2.5-coder-1.5b", help="preset or directory of the language model")
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--visual-scale", type=float, default=0.1,
                        help="RMS of a visual token's embedding as a share of a text token's")
    parser.add_argument("--no-check", action="store_true", help="skip the text-equality check")
    args = parser.parse_args()
    out = build(args.out.expanduser(), args.base, args.vision_depth, args.seed, args.visual_scale)
    print(f"wrote {out}")
    if not args.no_check:
        check_text(out, args.base)


if __name__ == "__main__":
    main()
