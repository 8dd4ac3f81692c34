"""Deterministic long prompts (2k-16k target tokens) from documentation shipped on this machine.

The document is the concatenation of the package descriptions (dist-info METADATA: each package's
README) of a fixed, sorted list of packages installed in the venv, cut at a token boundary so that the
chat-templated prompt (document + a summarisation question at the end) has the requested length
(within a couple of tokens: the cut text is re-tokenized).

    python benchmarks/long_prompts.py --lengths 2048 4096   # prints the real lengths and the prompt ends
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

PACKAGES = ("accelerate", "click", "huggingface_hub", "matplotlib", "psutil", "pydantic", "rich", "tqdm",
            "transformers", "typer")
QUESTION = ("Question: the text above is the documentation of several Python libraries, each starting with a "
            "'# name' heading. List every library documented above and say in one sentence what each one does.")


def documentation(site_packages: Path | None = None) -> str:
    root = Path(site_packages or sysconfig.get_paths()["purelib"])
    parts = []
    for package in sorted(PACKAGES):
        matches = sorted(root.glob(f"{package}-*.dist-info/METADATA"))
        if not matches:
            raise ValueError(f"no installed documentation for {package!r} under {root}")
        body = matches[0].read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[-1]  # drop the headers
        parts.append(f"# {package}\n\n{body.strip()}\n")
    return "\n".join(parts)


def build_prompt(tokenizer, length: int, text: str | None = None) -> list[int]:
    """Chat-templated token ids of about `length` tokens: the first part of the documentation, then QUESTION."""
    text = documentation() if text is None else text
    doc_ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(num_doc_tokens: int) -> list[int]:
        doc = tokenizer.decode(doc_ids[:num_doc_tokens])
        return tokenizer.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{QUESTION}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)

    overhead = len(encode(0))
    if length <= overhead or length - overhead > len(doc_ids):
        raise ValueError(f"length must lie in ({overhead}, {overhead + len(doc_ids)}], got {length}")
    ids = encode(length - overhead)
    while len(ids) > length:  # re-tokenizing the cut may merge or split a token or two
        ids = encode(length - overhead - (len(ids) - length))
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    from sparrow.models import load_model

    tokenizer = load_model(args.model, progress=False).tokenizer
    text = documentation()
    for length in args.lengths:
        ids = build_prompt(tokenizer, length, text)
        print(length, len(ids), repr(tokenizer.decode(ids[-60:])))


if __name__ == "__main__":
    main()
