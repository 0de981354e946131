"""Tokens per second of the two decoding loops: rlhf.decode's static-cache loop against the reference loop of
rlhf.rollout (a forward pass of the model per token), on the same prompts, noise and model.

    python bench/decode_speed.py                      # the embedded default's shape and a 2-layer Qwen2.5-0.5B shape
    python bench/decode_speed.py --rounds 9 --compiled   # also torch.compile's step (its compile time is printed)
    python bench/decode_speed.py --device cuda        # on a GPU, under bf16 autocast
    python bench/decode_speed.py --models warm-start --warm-start outputs/cache/embedded-<hash>   # stops at EOS

Models (random weights: the speed depends on the shape, not on the values):
- embedded: the embedded default's model (rlhf.embedded.EmbeddedConfig: hidden 128, 4 layers, 4 heads, 2 KV
  heads, its ~500-token vocabulary), 64 prompts (a step of configs/tiny.yaml) x 64 tokens;
- qwen: Qwen2.5-0.5B's width and 151,936-token vocabulary with --qwen-layers of its 24 layers (2 by default),
  8 prompts x 64 tokens.
- warm-start: the embedded default's warm-started model (a cache entry of rlhf.embedded, --warm-start) on 64 of
  its held-out problems, sampling at temperature 1 and stopping at EOS as training does (the only case here where
  responses end early, so the stop check every few tokens and its noise replay are in the time).
Prompts are generated GSM8K-style problems in the embedded tokenizer's chat template, left-padded (8-60 tokens).
Every response runs to the full length (`ignore_eos`), so both loops decode the same number of tokens. The rounds
alternate the two loops (reference first in odd rounds); the report gives each loop's median tokens/s and the
median of the per-round ratios (a paired comparison: both loops of a round ran under the same load), and checks
that both returned the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (bench/common.py says why)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from rlhf.rollout import SamplingParams, left_pad, next_token, paired_noise_generator  # noqa: E402

QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                    vocab_size=151_936, tie_word_embeddings=True)  # bench/recipe_memory.py's shape


def tokenizer_and_prompts(num_prompts: int):
    """The embedded tokenizer (trained on generated problems) and `num_prompts` chat-templated prompts."""
    from rlhf.embedded import generate_problems, train_tokenizer

    problems = generate_problems(max(num_prompts, 256), seed=0)
    tokenizer = train_tokenizer([p["question"] + " " + p["answer"] for p in problems], vocab_size=500)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["question"]}], tokenize=False,
                                           add_generation_prompt=True) for p in problems[:num_prompts]]
    return tokenizer, tokenizer(texts, add_special_tokens=False)["input_ids"]


def warm_start(directory: str):
    """(model, tokenizer, prompts) of an embedded cache entry: its model and 64 held-out prompts."""
    import json

    from rlhf.data import build_prompt
    from rlhf.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(os.path.join(directory, "model"))
    with open(os.path.join(directory, "val.jsonl")) as f:
        rows = [json.loads(line) for line in f][:64]
    prompts = tokenizer([build_prompt(tokenizer, r["question"]) for r in rows], add_special_tokens=False)["input_ids"]
    return load_causal_lm(os.path.join(directory, "model")).eval(), tokenizer, prompts


def build(name: str, qwen_layers: int, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.embedded import EmbeddedConfig, build_model

    torch.manual_seed(0)
    if name == "embedded":
        return build_model(EmbeddedConfig(), tokenizer).eval()
    config = Qwen2Config(**QWEN2_5_0_5B, num_hidden_layers=qwen_layers, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Qwen2ForCausalLM(config).eval()


def run(model, prompt_ids, prompt_mask, params, autocast: bool, reference: bool, compiled: bool = False,
        stop_ids=None):
    """(seconds, tokens) of one decode, synchronised on a GPU; `stop_ids` None decodes every token."""
    from rlhf import decode

    generator = paired_noise_generator(0, 1, 0, prompt_ids.device)
    device = prompt_ids.device.type
    start = time.perf_counter()
    with torch.inference_mode() if not autocast else torch.no_grad(), \
            torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        pick = lambda logits: next_token(logits, params, generator)  # noqa: E731
        if reference:
            tokens, _ = decode.reference_decode(model, prompt_ids, prompt_mask,
                                                decode.Decoding(params.max_new_tokens, pick, params.temperature,
                                                                stop_ids, 0))
        else:
            how = decode.Decoding(params.max_new_tokens, pick, params.temperature, None if compiled else stop_ids, 0,
                                  generator)
            tokens, _ = decode.decode(model, prompt_ids, prompt_mask, how,
                                      step_type=decode.CompiledTokenStep if compiled else decode.TokenStep)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def measure(name: str, args, tokenizer, prompts) -> None:
    from rlhf.rollout import stop_token_ids

    device = torch.device(args.device)
    stop_ids = None
    if name == "warm-start":
        model, tokenizer, prompts = warm_start(args.warm_start)
        stop_ids = stop_token_ids(model, tokenizer)
    else:
        model = build(name, args.qwen_layers, tokenizer)
    model = model.to(device)
    num_prompts = 8 if name == "qwen" else 64
    prompt_ids, prompt_mask = left_pad(prompts[:num_prompts], tokenizer.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=stop_ids is None)
    autocast = device.type == "cuda"
    num_tokens = num_prompts * args.tokens  # decoded per round; with stops, the tokens decoded until all stopped
    run(model, prompt_ids, prompt_mask, params, autocast, reference=True, stop_ids=stop_ids)  # warm-up of both
    run(model, prompt_ids, prompt_mask, params, autocast, reference=False, stop_ids=stop_ids)
    seconds = {"reference": [], "static": []}
    same, note = True, None
    for i in range(args.rounds):
        order = ("reference", "static") if i % 2 == 0 else ("static", "reference")
        tokens = {}
        for side in order:
            s, tokens[side] = run(model, prompt_ids, prompt_mask, params, autocast, reference=side == "reference",
                                  stop_ids=stop_ids)
            seconds[side].append(s)
        same &= torch.equal(tokens["reference"], tokens["static"])
    if stop_ids is not None:  # the reference loop decodes until the longest response's stop
        lengths = (tokens["reference"] != tokenizer.pad_token_id).sum(dim=1)
        num_tokens = num_prompts * int(lengths.max())
        note = f"  responses stop at EOS: longest {int(lengths.max())} tokens, mean {lengths.float().mean():.1f}"
    ratios = [r / s for r, s in zip(seconds["reference"], seconds["static"])]
    width = prompt_ids.shape[1]
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {num_prompts} prompts "
          f"(padded to {width}) x {args.tokens} tokens, {args.rounds} rounds, {args.device}"
          f"{' bf16 autocast' if autocast else ''}")
    if note:
        print(note)
    for side in ("reference", "static"):
        median = statistics.median(seconds[side])
        print(f"  {side:9s} loop: {num_tokens / median:8.0f} tokens/s  ({median * 1e3 / args.tokens:.2f} ms a token)")
    print(f"  static / reference speed: median of per-round ratios {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); same tokens: {same}")
    if args.compiled:
        start = time.perf_counter()
        run(model, prompt_ids, prompt_mask, params, autocast, reference=False, compiled=True)
        compile_s = time.perf_counter() - start
        times = [run(model, prompt_ids, prompt_mask, params, autocast, False, compiled=True)[0]
                 for _ in range(args.rounds)]
        print(f"  compiled step: first call {compile_s:.1f} s (the compilation), then "
              f"{num_tokens / statistics.median(times):.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,qwen", help="comma-separated: embedded, qwen, warm-start")
    parser.add_argument("--warm-start", help="an embedded cache entry (<trainer.cache_dir>/embedded-<hash>)")
    parser.add_argument("--qwen-layers", type=int, default=2, help="decoder layers of the Qwen2.5-0.5B-shaped model")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiled", action="store_true", help="also time rlhf.decode's torch.compile'd step")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = sorted(set(names) - {"embedded", "qwen", "warm-start"})
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from embedded, qwen, warm-start")
    if "warm-start" in names and not (args.warm_start and os.path.isfile(os.path.join(args.warm_start, "val.jsonl"))):
        parser.error("--models warm-start needs --warm-start <an embedded cache entry with model/ and val.jsonl>")
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    tokenizer, prompts = tokenizer_and_prompts(64)
    for name in names:
        measure(name, args, tokenizer, prompts)


if __name__ == "__main__":
    main()
