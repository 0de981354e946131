"""The embedded default: a GSM8K-shaped task a CPU can learn, with no network.

    artifacts = prepare_embedded_default("outputs/cache", EmbeddedConfig())
    # artifacts.model_dir: a save_pretrained directory (tiny Qwen2 + tokenizer), loadable by path
    # artifacts.train_file / artifacts.val_file: GSM8K-schema JSON lines (question, answer)

What it builds, in order:
1. Word problems from templates (names, objects, one to three +, -, *, / steps, small numbers), with
   answers in GSM8K's exact format: one `a+b=<<a+b=c>>c` line per step, then `#### N`. The GSM8K
   reader and the reward therefore run unchanged on them.
2. A byte-level BPE tokenizer trained on that text with the `tokenizers` library. Digits are always single
   tokens (as in Llama/Qwen tokenizers), so arithmetic is digit by digit and learnable by a tiny model.
   It has a minimal ChatML template, so the chat-template path of `build_prompt` is the one exercised.
3. A tiny Qwen2ForCausalLM from a Qwen2Config (random init, tied embeddings).
4. A short supervised warm start: next-token loss on the solution tokens only, given the prompt from
   `build_prompt`, ending with EOS. It leaves the policy mid-range on purpose: it solves some problems
   (so sampled rewards are not all zero) and fails on many (so PPO has something to improve).

The warm-start demos carry one planted habit: in `sft_early_answer_frac` of the multi-step demos the
final line reports the *first* step's result instead of the last (answering a sub-question, a common
GSM8K error). The data files and the reward are unaffected. Why: with clean demos, a few hundred
CPU-seconds of PPO on this model barely move greedy accuracy (it has to learn more arithmetic, which
is slow); a habit the reward contradicts is what RL removes quickly, so the RL loop shows its effect
within minutes (held-out greedy accuracy 0.39 -> 0.54-0.63 in 40 steps of `configs/tiny.yaml` over four
seeds on one machine; docs/results.md has the breakdown), much like RL fine-tuning mostly reshapes which of
its known behaviours a pretrained model uses. `sft_early_answer_frac=0` gives clean demos.

Everything is cached under `cache_dir/embedded-<hash of the config>`; a second call is near-instant. The build
runs in a child process pinned to kernels every x86-64 CPU runs alike (`BUILD_ENV`), so the test bed is the
same bytes on every machine; `sha256_of_entry` names it.

Simplifications: the problems are far easier than GSM8K (one quantity, at most three operations, numbers
up to `max_value`), and the model is ~1M parameters; this is a test bed for the RL loop, not a benchmark.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# transformers, tokenizers, `rlhf.data` (datasets) and `rlhf.models` are imported inside the functions
# that need them, so that importing this module stays fast.

# Bump when the generated data, tokenizer or warm start change, so stale caches are not reused.
_CACHE_VERSION = 4

# The environment the build runs in. Which kernels a float sum takes changes its last bits, and 400 warm-start
# steps carry them into another model (docs/results.md, "One test bed on every machine"). ATen picks its SIMD
# kernels by the CPU (the baseline ones run alike on any x86-64), MKL picks its matrix-product path by the CPU
# (its reproducibility mode COMPATIBLE takes one path everywhere), and the thread count splits sums; oneDNN's
# ISA left the weights unchanged when measured and is capped anyway. torch reads them all when it loads, so
# they hold only in a fresh process.
BUILD_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class EmbeddedConfig:
    """The embedded default's options (`task.options` of task `embedded`): problems, tokenizer, tiny model, warm start."""

    num_train: int = 2048  # training problems written to train.jsonl
    num_val: int = 256  # held-out problems written to val.jsonl (disjoint questions from train)
    seed: int = 0  # seeds the problem generator, the model init and the warm start
    max_difficulty: int = 3  # most arithmetic steps per problem (each problem has 1..max_difficulty)
    max_value: int = 20  # every operand and intermediate result lies in [1, max_value]
    vocab_size: int = 512  # BPE vocabulary size (upper bound; a small corpus may yield fewer tokens)
    hidden_size: int = 128  # model width
    intermediate_size: int = 384  # MLP width
    num_layers: int = 4  # transformer blocks
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention, as in Qwen2)
    max_position_embeddings: int = 512  # longest sequence (prompt + response) the model is built for
    sft_steps: int = 400  # supervised warm-start optimizer steps (0 = leave the model random)
    sft_batch_size: int = 32  # problems per warm-start step
    sft_lr: float = 3e-3  # peak AdamW learning rate of the warm start (linear warmup, cosine decay)
    sft_warmup_steps: int = 20  # linear warmup steps of the warm start
    sft_early_answer_frac: float = 0.8  # share of multi-step demos whose "#### N" gives the first step's result


def embedded_options(cfg) -> EmbeddedConfig:
    """The embedded default's options in config `cfg`: its task.options for task `embedded`, the defaults
    for another task that names the embedded model or files."""
    from rlhf.schema import build

    return build(EmbeddedConfig, cfg.task.options, "task.options.") if cfg.task.name == "embedded" else EmbeddedConfig()


@dataclass
class EmbeddedArtifacts:
    model_dir: str  # save_pretrained directory holding the warm-started model and its tokenizer
    train_file: str  # GSM8K-schema JSON lines: question, answer
    val_file: str  # same, held-out
    sft_val_loss_before: float  # warm-start loss (solution tokens) on held-out problems, before ...
    sft_val_loss_after: float  # ... and after the warm start
    sft_time_s: float  # wall time of the warm start when it ran (cache hits report the original run)


# ----------------------------------------------------------------------------- problem generator

_NAMES = [("Tom", "he", "him"), ("Anna", "she", "her"), ("Ben", "he", "him"), ("Lily", "she", "her"),
          ("Sam", "he", "him"), ("Mia", "she", "her"), ("Leo", "he", "him"), ("Emma", "she", "her"),
          ("Jack", "he", "him"), ("Nora", "she", "her"), ("Omar", "he", "him"), ("Zoe", "she", "her"),
          ("Ravi", "he", "him"), ("Lucy", "she", "her"), ("Max", "he", "him"), ("Ivy", "she", "her")]
_OBJECTS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells", "coins",
            "flowers", "stamps", "eggs", "balloons", "toy cars"]
_ADD = ["{He} buys {b} more.", "{He} finds {b} more.", "{Friend} gives {him} {b} more."]
_SUB = ["{He} gives {b} to {Friend}.", "{He} loses {b}.", "{He} sells {b}."]
_MUL = {2: "Then the number of {obj} doubles.", 3: "Then the number of {obj} triples."}
_DIV = "{He} puts them equally into {b} boxes."


def _line(a: int, op: str, b: int, c: int) -> str:
    """One GSM8K reasoning line with its calculator annotation: `12+7=<<12+7=19>>19`."""
    return f"{a}{op}{b}=<<{a}{op}{b}={c}>>{c}"


def _make_problem(rng: random.Random, num_steps: int, max_value: int) -> dict:
    """One problem: a starting amount (or bags x items) changed by a chain of steps; division only last."""
    name, he, him = rng.choice(_NAMES)
    friend = rng.choice([n for n, _, _ in _NAMES if n != name])
    obj = rng.choice(_OBJECTS)
    fill = {"He": he.capitalize(), "him": him, "Friend": friend, "obj": obj}
    lines = []
    if rng.random() < 0.3:  # the first step is a product: bags of objects
        bags = rng.randint(2, 5)
        per_bag = rng.randint(2, max(2, max_value // bags))
        value = bags * per_bag
        sentences = [f"{name} has {bags} bags with {per_bag} {obj} in each bag."]
        lines.append(_line(bags, "*", per_bag, value))
    else:
        value = rng.randint(2, max_value - 1)
        sentences = [f"{name} has {value} {obj}."]
    question = f"How many {obj} does {name} have now?"
    while len(lines) < num_steps:
        last = len(lines) == num_steps - 1
        ops = ["+"] * (value < max_value) + ["-"] * (value > 1) + ["*"] * (2 * value <= max_value)
        divisors = [d for d in range(2, 6) if value % d == 0]
        if last and divisors:
            ops.append("/")
        op = rng.choice(ops)
        if op == "+":
            b = rng.randint(1, min(10, max_value - value))
            new, sentence = value + b, rng.choice(_ADD)
        elif op == "-":
            b = rng.randint(1, min(10, value - 1))
            new, sentence = value - b, rng.choice(_SUB)
        elif op == "*":
            b = rng.choice([k for k in (2, 3) if k * value <= max_value])
            new, sentence = value * b, _MUL[b]
        else:
            b = rng.choice(divisors)
            new, sentence = value // b, _DIV
            question = f"How many {obj} are in each box?"
        sentences.append(sentence.format(b=b, **fill))
        lines.append(_line(value, op, b, new))
        value = new
    return {"question": " ".join(sentences + [question]), "answer": "\n".join(lines + [f"#### {value}"])}


def generate_problems(num: int, seed: int, max_difficulty: int = EmbeddedConfig.max_difficulty,
                      max_value: int = EmbeddedConfig.max_value) -> list[dict]:
    """`num` distinct GSM8K-style problems {"question", "answer"}, deterministic by `seed`.

    Each has 1..max_difficulty arithmetic steps (uniformly), all numbers in [1, max_value]. Questions are
    unique within the list, so any split of it into train and held-out parts cannot overlap.
    """
    if max_difficulty < 1 or max_value < 10:
        raise ValueError(f"need max_difficulty >= 1 and max_value >= 10, got {max_difficulty}, {max_value}.")
    rng = random.Random(seed)
    problems, seen = [], set()
    for _ in range(100 * num):
        if len(problems) == num:
            break
        problem = _make_problem(rng, rng.randint(1, max_difficulty), max_value)
        if problem["question"] not in seen:
            seen.add(problem["question"])
            problems.append(problem)
    if len(problems) < num:
        raise ValueError(f"only {len(problems)} distinct problems found for num={num}; raise max_value.")
    return problems


# ----------------------------------------------------------------------------- tokenizer and model

_PAD, _BOS_TURN, _EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen uses, reduced to what `build_prompt` needs: turns, then the assistant header.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, with single-digit tokens and a chat template,
    as a transformers PreTrainedTokenizerFast (eos `<|im_end|>`, pad `<|endoftext|>`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer: its regex cuts text into words, single digits (`\p{N}`), punctuation runs and
    # whitespace, so no merge can join two digits. It must be Qwen2's exactly: AutoTokenizer rebuilds any
    # tokenizer saved next to a Qwen2 config with this pre-tokenizer, whatever tokenizer.json says.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[_PAD, _BOS_TURN, _EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_EOS, pad_token=_PAD,
                                   chat_template=_CHAT_TEMPLATE, padding_side="left")


def build_model(cfg: EmbeddedConfig, tokenizer):
    """A randomly initialised tiny Qwen2ForCausalLM sized by `cfg` (tied input/output embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


# ----------------------------------------------------------------------------- supervised warm start


def _sft_examples(problems: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids + [eos]) per problem, tokenized separately exactly as in a rollout."""
    from rlhf.data import build_prompt

    prompts = [build_prompt(tokenizer, p["question"]) for p in problems]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer([p["answer"] for p in problems], add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompt_ids, response_ids)]


def first_step_result(answer: str) -> str:
    """The result of a generated solution's first line: "3+4=<<3+4=7>>7\n..." -> "7"."""
    return answer.split("\n", 1)[0].rsplit(">>", 1)[1]


def answer_with_first_result(answer: str) -> str:
    """The same reasoning lines, but the final `#### N` line reports the first line's result."""
    *lines, _ = answer.split("\n")
    return "\n".join(lines + [f"#### {first_step_result(answer)}"])


def warm_start_demos(problems: list[dict], cfg: EmbeddedConfig) -> list[dict]:
    """The demos the warm start imitates: `problems`, except that `cfg.sft_early_answer_frac` of the
    multi-step ones (chosen by `cfg.seed`) end with the first step's result (the planted habit)."""
    rng = random.Random(cfg.seed)
    return [{**p, "answer": answer_with_first_result(p["answer"])}
            if p["answer"].count("\n") >= 2 and rng.random() < cfg.sft_early_answer_frac else p
            for p in problems]


def _collate(examples, pad_token_id: int):
    """Right-padded (input_ids, attention_mask, labels), each (B, T); labels are -100 off the solution."""
    length = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r)
        attention_mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(r)
    return input_ids, attention_mask, labels


def _solution_loss(model, batch) -> torch.Tensor:
    """Mean next-token cross-entropy over the solution tokens (float32)."""
    input_ids, attention_mask, labels = batch
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def supervised_warm_start(model, tokenizer, train: list[dict], val: list[dict], cfg: EmbeddedConfig,
                          log=print) -> tuple[float, float]:
    """Train `model` in place for `cfg.sft_steps` AdamW steps on the solution tokens of `train`; returns
    the loss on (up to 64) `val` problems before and after."""
    examples = _sft_examples(warm_start_demos(train, cfg), tokenizer)
    val_batch = _collate(_sft_examples(val[:64], tokenizer), tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:  # linear warmup, then cosine decay to 10% of the peak
        if step < cfg.sft_warmup_steps:
            return cfg.sft_lr * (step + 1) / cfg.sft_warmup_steps
        progress = (step - cfg.sft_warmup_steps) / max(1, cfg.sft_steps - cfg.sft_warmup_steps)
        return cfg.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.eval()
    with torch.no_grad():
        loss_before = _solution_loss(model, val_batch).item()
    model.train()
    order, cursor = torch.randperm(len(examples), generator=generator), 0
    for step in range(cfg.sft_steps):
        if cursor + cfg.sft_batch_size > len(order):  # new epoch
            order, cursor = torch.randperm(len(examples), generator=generator), 0
        batch = _collate([examples[i] for i in order[cursor:cursor + cfg.sft_batch_size]], tokenizer.pad_token_id)
        cursor += cfg.sft_batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = _solution_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            log(f"[embedded] warm start step {step + 1}/{cfg.sft_steps}: loss {loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        loss_after = _solution_loss(model, val_batch).item()
    return loss_before, loss_after


# ----------------------------------------------------------------------------- the cached entry point


def config_hash(cfg: EmbeddedConfig) -> str:
    """A short hash of every field of `cfg` (and the cache version): the cache key."""
    payload = json.dumps({"version": _CACHE_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def embedded_cache_dir(cfg) -> str:
    """Where a run of config `cfg` (an rlhf.config.Config) builds and caches the embedded default:
    trainer.cache_dir, else <output_dir>/embedded."""
    return cfg.trainer.cache_dir or os.path.join(cfg.trainer.output_dir, "embedded")


def cache_entry(cache_dir: str, cfg: EmbeddedConfig) -> str:
    """The directory under `cache_dir` that holds the task built from `cfg`: `embedded-<config_hash(cfg)>`."""
    return os.path.join(cache_dir, f"embedded-{config_hash(cfg)}")


def _artifacts(root: str) -> EmbeddedArtifacts:
    with open(os.path.join(root, "meta.json"), encoding="utf-8") as f:
        metrics = json.load(f)["metrics"]
    return EmbeddedArtifacts(model_dir=os.path.join(root, "model"), train_file=os.path.join(root, "train.jsonl"),
                             val_file=os.path.join(root, "val.jsonl"), **metrics)


def _build(tmp: str, cfg: EmbeddedConfig, log) -> dict[str, float]:
    """Write the problems, the tokenizer and the warm-started model into `tmp`; return meta.json's metrics."""
    from rlhf.data import INSTRUCTION, write_jsonl
    from rlhf.models import load_tokenizer

    problems = generate_problems(cfg.num_train + cfg.num_val, cfg.seed, cfg.max_difficulty, cfg.max_value)
    val, train = problems[:cfg.num_val], problems[cfg.num_val:]
    write_jsonl(train, os.path.join(tmp, "train.jsonl"))
    write_jsonl(val, os.path.join(tmp, "val.jsonl"))

    texts = ["user", "assistant"] + [f"{p['question']} {INSTRUCTION}\n{p['answer']}" for p in train]
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tokenizer)
    # Warm-start with the tokenizer exactly as the trainer will load it from disk (AutoTokenizer picks the
    # class from the model config), so the ids seen in the warm start and in PPO cannot differ.
    model_dir = os.path.join(tmp, "model")
    model.config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"[embedded] {len(train)} train / {len(val)} val problems, vocab {len(tokenizer)}, "
        f"model {num_params / 1e6:.2f}M parameters; warm start: {cfg.sft_steps} steps x {cfg.sft_batch_size}")

    sft_start = time.perf_counter()
    loss_before, loss_after = supervised_warm_start(model, tokenizer, train, val, cfg, log)
    model.save_pretrained(model_dir)
    return {"sft_val_loss_before": loss_before, "sft_val_loss_after": loss_after,
            "sft_time_s": time.perf_counter() - sft_start}


def _build_in_child(tmp: str, cfg: EmbeddedConfig, log) -> None:
    """Run `_build` into `tmp` in a fresh Python under `BUILD_ENV`, passing its output lines to `log`; it writes
    meta.json last."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **BUILD_ENV,
           "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import sys; from rlhf.embedded import _build_main; _build_main(sys.argv[1], sys.argv[2])"
    args = [sys.executable, "-c", code, tmp, json.dumps(dataclasses.asdict(cfg))]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            log(line.rstrip("\n"))
    if child.returncode != 0:
        raise RuntimeError(f"building the embedded default failed (exit code {child.returncode}); its error is above.")


def _build_main(tmp: str, cfg_json: str) -> None:
    """The child's side of `_build_in_child`: build into `tmp`, then write meta.json."""
    cfg = EmbeddedConfig(**json.loads(cfg_json))
    metrics = _build(tmp, cfg, log=lambda line: print(line, flush=True))
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"config": dataclasses.asdict(cfg), "metrics": metrics}, f, indent=2)


def sha256_of_entry(root: str) -> str:
    """sha256 of a cache entry's test bed: the problem files' bytes, the tokenizer's vocabulary and merges, and
    the weights (each tensor's name, shape and float32 bytes), so file formats and library versions that save
    the same content the same way do not change it."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name in ("train.jsonl", "val.jsonl"):
        with open(os.path.join(root, name), "rb") as f:
            digest.update(f.read())
    with open(os.path.join(root, "model", "tokenizer.json"), encoding="utf-8") as f:
        model = json.load(f)["model"]
    digest.update(json.dumps([model["vocab"], model["merges"]], sort_keys=True).encode())
    weights = load_file(os.path.join(root, "model", "model.safetensors"))
    for name in sorted(weights):
        digest.update(f"{name}{tuple(weights[name].shape)}".encode())
        digest.update(weights[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def prepare_embedded_default(cache_dir: str, cfg: EmbeddedConfig, log=print) -> EmbeddedArtifacts:
    """Build (or reuse from `cache_dir`) the embedded task: train/val JSON lines and a warm-started tiny
    model with its tokenizer. Deterministic by `cfg.seed`; the cache is keyed on a hash of `cfg`.

    Built in a child process under `BUILD_ENV`, so the entry is the same bytes whichever machine, thread
    count or process builds it. Written atomically (a temporary directory renamed into place), so an
    interrupted run or a second process writing the same entry never leaves a half-written cache behind.
    """
    root = cache_entry(cache_dir, cfg)
    if os.path.isdir(root):
        log(f"[embedded] reusing {root}")
        return _artifacts(root)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = os.path.join(cache_dir, f".tmp-{os.path.basename(root)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()

    _build_in_child(tmp, cfg, log)
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished the same entry first: theirs is identical, keep it
        if not os.path.isdir(root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    artifacts = _artifacts(root)
    log(f"[embedded] held-out loss {artifacts.sft_val_loss_before:.3f} -> {artifacts.sft_val_loss_after:.3f}; "
        f"built in {time.perf_counter() - start:.0f}s at {root}; test bed sha256 {sha256_of_entry(root)[:16]}")
    return artifacts


# ----------------------------------------------------------------------------- the planted habit, measured

CATEGORIES = ("correct", "first_step", "other")


def classify(response: str, answer: str, method: str = "strict") -> str:
    """"correct", "first_step" (the final answer is the first step's result, and that is wrong) or "other"."""
    from rlhf.rewards.gsm8k import compute_score, extract_ground_truth

    if compute_score(response, extract_ground_truth(answer), method=method) == 1.0:
        return "correct"
    if compute_score(response, first_step_result(answer), method=method) == 1.0:
        return "first_step"
    return "other"


def habit_metric(answers: list[str], method: str = "strict"):
    """The embedded default's `habit_rate` (rlhf.held_out.ResponseMetric): 1 for a response to held-out row
    i whose final answer is the first step's result of `answers[i]` and wrong ("first_step"), else 0."""

    def habit_rate(completions, indices):
        return [float(classify(text, answers[i], method) == "first_step") for text, i in zip(completions, indices)]

    return habit_rate


def held_out_problems(cfg, log=lambda *_: None):
    """(the embedded default's artifacts, its held-out problems with their answers) for config `cfg` (an
    rlhf.config.Config): the first data.max_val_samples of them, as the trainer evaluates; the cache is built
    if missing."""
    from rlhf.data import load_gsm8k

    artifacts = prepare_embedded_default(embedded_cache_dir(cfg), embedded_options(cfg), log=log)
    problems = load_gsm8k(artifacts.val_file, cfg.data.val_split, cfg.data.subset)
    if cfg.data.max_val_samples:
        problems = problems.select(range(min(cfg.data.max_val_samples, len(problems))))
    return artifacts, problems
