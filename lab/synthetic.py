"""Two synthetic tasks whose fixed points are exact: a one-token bandit and a two-token tree.

    python train.py --config configs/bandit.yaml actor.use_kl_loss=true actor.kl_loss_type=k3    # forward KL
    python train.py --config configs/tree.yaml                                                    # sequence level

Built like the embedded default (no network, a cache entry, a tiny model), and trained by the same
`train_step` as GSM8K:
- `bandit`: one prompt, responses of exactly one token, reward r(token) from a table fixed by `task.options.seed`.
- `tree`: responses of exactly two tokens (a, b), reward R(a, b) at the end: docs/kl.md's two-step example
  (`TREE_EXAMPLE`), whose sequence-level and token-level optima differ.
The vocabulary is small enough to enumerate: the prompt token `<s>` (also EOS and padding, so that every
token is an arm and every response has the same length) and the arm tokens a0, a1, ... pi_ref is the
reference model's next-token distribution after the prompt (and after each first token, for the tree): a
tiny Qwen2 fitted to a clearly non-uniform target, so the candidate optima are far apart.

Each row carries the task's reward table (`rewards`), so the default reward, `lab.synthetic:table_reward`,
is a plain `reward.function` like any other; the theory (`Landing`) evaluates the *configured* function on
every arm (every pair for the tree), so a user's own reward gets its fixed point too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import hashlib
import json
import os
import shutil

import torch

from rlhf import kl
from rlhf.tasks import get_task, task_options

TASKS = ("bandit", "tree")  # the two tasks: task.name lab.tasks:bandit or lab.tasks:tree
@dataclass
class SyntheticConfig:
    """The synthetic tasks' options (`task.options` of lab.tasks:bandit or :tree): a tiny model whose policy can be enumerated."""

    num_arms: int = 6  # bandit: arm tokens a0 ... (the vocabulary is these and the prompt token <s>, itself an arm); the tree has docs/kl.md's example's three
    seed: int = 2  # bandit: seeds the reward table and the reference's target (2: its forward- and reverse-KL optima at beta = 0.3 lie 0.246 apart in TV)
    binary: bool = False  # bandit: rewards 0/1 (1 on the best quarter of the arms) instead of uniform on [0, 1]
    ref_spread: float = 1.5  # bandit: std of the Gaussian logits of the reference's target (0 = uniform)
    tree_prompt_mass: float = 0.001  # tree: the reference's probability of <s> (an arm with reward 0) in every state
    hidden_size: int = 32  # model width (one transformer block)
    num_prompts: int = 256  # rows of the training set (all the one prompt)
    fit_steps: int = 300  # Adam steps fitting the reference to its target
    fit_lr: float = 0.03  # their learning rate


def task_of(cfg) -> str | None:
    """"bandit" or "tree" for a run of config `cfg` on a synthetic task (lab.tasks), None otherwise."""
    return getattr(get_task(cfg.task.name), "synthetic_kind", None)


PROMPT_TOKEN = "<s>"
_CACHE_VERSION = 1


def arm_tokens(num_arms: int) -> list[str]:
    """The vocabulary in id order: the prompt token first (id 0), then a0 ... a{num_arms - 1}."""
    return [PROMPT_TOKEN] + [f"a{i}" for i in range(num_arms)]


def response_length(task: str) -> int:
    """Tokens per response: 1 for the bandit, 2 for the tree."""
    return TASKS.index(task) + 1


def check_config(cfg) -> None:
    """Raise ValueError unless a run on a synthetic task is one the analysis models: the data is the task's
    own, every response has the task's length, one KL placement at most, a temperature the policy is read at."""
    task, d, r = task_of(cfg), cfg.data, cfg.rollout
    length = response_length(task)
    if d.max_response_length != length or not r.ignore_eos:
        raise ValueError(f"the {task}'s responses are exactly {length} token(s): set data.max_response_length="
                         f"{length} and rollout.ignore_eos=true (got {d.max_response_length} and {r.ignore_eos})")
    if r.top_k or r.top_p < 1.0:
        raise ValueError("the fixed points assume samples of pi: rollout.top_k=0 and rollout.top_p=1.0 on a "
                         "synthetic task")
    if cfg.algorithm.use_kl_in_reward and cfg.actor.use_kl_loss:
        raise ValueError("the fixed points model one KL placement: set algorithm.use_kl_in_reward or "
                         "actor.use_kl_loss, not both")
    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.type != "fixed":
        raise ValueError("the fixed points are those of one coefficient: algorithm.kl_ctrl.type=fixed on a "
                         "synthetic task")
    ac = cfg.actor
    if ac.use_kl_loss and ac.kl_loss_off_policy_correction and kl.canonical(ac.kl_loss_type) not in ("k1", "k3"):
        raise ValueError(f"the fixed points model actor.kl_loss_off_policy_correction for k1 and k3 (whose "
                         f"corrected gradient is k2's on-policy), not for {ac.kl_loss_type}")
    options = task_options(cfg)
    if options.num_arms < 1:
        raise ValueError(f"task.options.num_arms must be >= 1, got {options.num_arms}")
    if not 0 < options.tree_prompt_mass < 1:
        raise ValueError(f"task.options.tree_prompt_mass must be in (0, 1), got {options.tree_prompt_mass}")


# ----------------------------------------------------------------------------- the task's tables


def _tree_example() -> dict:
    """docs/kl.md's two-step example, lab.theory.examples.TREE_EXAMPLE: imported on use, so that the trainer
    loads the analysis (lab.theory) only for a synthetic task."""
    from lab.theory.examples import TREE_EXAMPLE

    return TREE_EXAMPLE


def num_tokens(task: str, cfg) -> int:
    """V, the vocabulary: the prompt token and the arms (task.options.num_arms for the bandit; the tree has the
    three of docs/kl.md's example)."""
    return 1 + (cfg.num_arms if task == "bandit" else len(_tree_example()["ref_first"]))


def _anti_sorted(logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The same logits reassigned so that the higher an arm's reward, the lower its logit."""
    out = torch.empty_like(logits)
    out[torch.argsort(rewards)] = torch.sort(logits, descending=True).values
    return out


def reward_table(task: str, cfg) -> torch.Tensor:
    """r (V,) for the bandit, R (V, V) for the tree, float64.

    bandit: uniform on [0, 1] from `cfg.seed`, rounded to 2 decimals (readable in theory.json); with
    `cfg.binary`, 1 on the best quarter of the arms, else 0. tree: docs/kl.md's example (TREE_EXAMPLE: after
    a0, the best reward needs a token the reference gives 1%), 0 on any pair with the prompt token <s>."""
    if task == "bandit":
        table = torch.rand(num_tokens(task, cfg), generator=torch.Generator().manual_seed(cfg.seed),
                           dtype=torch.float64)
        if cfg.binary:
            table = (table >= table.quantile(0.75)).double()
        return (table * 100).round() / 100
    table = torch.zeros(num_tokens(task, cfg), num_tokens(task, cfg), dtype=torch.float64)
    table[1:, 1:] = torch.tensor(_tree_example()["rewards"], dtype=torch.float64)
    return table


def target_reference(task: str, cfg) -> torch.Tensor:
    """The distributions the reference model is fitted to, float64: (1, V) for the bandit, for the tree the
    first token's then the second token's after each first token, (V + 1, V).

    bandit: softmax of Gaussian logits with std `cfg.ref_spread` (from `cfg.seed + 1`), the larger logits on
    the lower rewards: the best arms are the rarest, so the forward- and reverse-KL optima are far apart.
    tree: TREE_EXAMPLE's pi_ref(a) and pi_ref(b | a), with `tree_prompt_mass` of each row on <s>. After <s>
    the sequence is <s> <s>, whose positions no RoPE model can tell apart (identical tokens, no absolute
    positions), so that row is the first token's."""
    if task == "bandit":
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        logits = cfg.ref_spread * torch.randn(num_tokens(task, cfg), generator=generator, dtype=torch.float64)
        return torch.softmax(_anti_sorted(logits, reward_table(task, cfg)), -1)[None]
    tree = _tree_example()
    arms = torch.tensor([tree["ref_first"], *tree["ref_second"]], dtype=torch.float64)
    rows = torch.cat([torch.full((len(arms), 1), cfg.tree_prompt_mass), (1 - cfg.tree_prompt_mass) * arms], dim=1)
    return torch.cat([rows[:1], rows[:1], rows[1:]])  # first token; after <s>; after each arm


# ----------------------------------------------------------------------------- tokenizer and model


def build_tokenizer(num_arms: int):
    """A word-level PreTrainedTokenizerFast over arm_tokens (ids 0..V-1), `<s>` as EOS and padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(arm_tokens(num_arms))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PROMPT_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=PROMPT_TOKEN, pad_token=PROMPT_TOKEN,
                                   padding_side="left")


def load_tokenizer(model_dir: str):
    """The task's tokenizer as saved. Not through AutoTokenizer, which rebuilds any tokenizer saved beside a
    Qwen2 config as Qwen2's byte-level BPE (transformers 5), losing the word-level vocabulary."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")


def build_model(cfg, vocab_size: int):
    """A tiny randomly initialised Qwen2ForCausalLM (untied embeddings, so the output layer is free)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8, tie_word_embeddings=False, eos_token_id=0,
                         bos_token_id=None, pad_token_id=None)  # no padding_idx: <s> keeps a learnable embedding
    return Qwen2ForCausalLM(config)


def policy_inputs(task: str, vocab_size: int) -> torch.Tensor:
    """The token sequences whose next-token distributions make up the policy: [[<s>]] for the bandit,
    [[<s>, a] for every a] for the tree (position 0 gives pi(a), position 1 gives pi(b | a))."""
    if task == "bandit":
        return torch.zeros(1, 1, dtype=torch.long)
    return torch.stack([torch.zeros(vocab_size, dtype=torch.long), torch.arange(vocab_size)], dim=1)


@torch.no_grad()
def policy(model, task: str, temperature: float = 1.0) -> torch.Tensor:
    """The model's policy over responses, float64: pi (V,) for the bandit; the joint pi(a, b) (V, V) for the
    tree. At the sampling temperature, as the trainer samples."""
    vocab_size = model.config.vocab_size
    ids = policy_inputs(task, vocab_size).to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits.double().cpu() / temperature  # (rows, positions, V)
    probs = torch.softmax(logits, -1)
    if task == "bandit":
        return probs[0, 0]
    return probs[0, 0][:, None] * probs[:, 1]  # pi(a) pi(b | a)


def fit_reference(model, task: str, target: torch.Tensor, steps: int, lr: float) -> float:
    """Fit the model's next-token distributions to `target` (target_reference's layout) by Adam on the
    cross-entropy; returns the final KL(target || model) summed over the rows."""
    vocab_size = model.config.vocab_size
    ids = policy_inputs(task, vocab_size)
    target = target.float()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        logprobs = torch.log_softmax(model(input_ids=ids).logits, -1)  # (rows, positions, V)
        rows = logprobs[:1, 0] if task == "bandit" else torch.cat([logprobs[:1, 0], logprobs[:, 1]])  # as target
        loss = (target * (target.log() - rows)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


# ----------------------------------------------------------------------------- the cached entry point


def cache_entry(cache_dir: str, task: str, cfg) -> str:
    """`cache_dir/<task>-<hash of cfg>`: the task's model directory lives in it."""
    payload = json.dumps({"version": _CACHE_VERSION, "task": task, **dataclasses.asdict(cfg)}, sort_keys=True)
    return os.path.join(cache_dir, f"{task}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}")


def prepare_synthetic(cache_dir: str, task: str, cfg, log=print) -> str:
    """Build (or reuse) the task's tokenizer and fitted reference model; returns the model directory (a
    save_pretrained directory, loadable by path). Deterministic by cfg.seed; written atomically."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; valid: {', '.join(TASKS)}")
    root = cache_entry(cache_dir, task, cfg)
    model_dir = os.path.join(root, "model")
    if os.path.isdir(root):
        log(f"[{task}] reusing {root}")
        return model_dir
    tmp = f"{root}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_tokenizer(num_tokens(task, cfg) - 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights whichever thread count builds them
    try:
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, len(tokenizer))
            residual = fit_reference(model, task, target_reference(task, cfg), cfg.fit_steps, cfg.fit_lr)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(os.path.join(tmp, "model"))
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"task": task, "config": dataclasses.asdict(cfg), "fit_kl": residual}, f, indent=2)
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished the same entry first: it is identical
        if not os.path.isdir(root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[{task}] vocabulary {len(tokenizer)}, reference fitted (KL to its target {residual:.1e}) at {root}")
    return model_dir


def build_datasets(task: str, cfg, tokenizer):
    """(train, val) Datasets: `cfg.num_prompts` copies of the one prompt (`<s>`) for training, one for
    evaluation, each row with `input_ids`, `ground_truth` (unused, empty) and `rewards` (the table, nested
    lists), which the reward function receives as a field."""
    import datasets

    table = reward_table(task, cfg).tolist()
    prompt = [tokenizer.convert_tokens_to_ids(PROMPT_TOKEN)]

    def rows(n):
        return datasets.Dataset.from_dict({"input_ids": [prompt] * n, "prompt": [PROMPT_TOKEN] * n,
                                           "ground_truth": [""] * n, "rewards": [table] * n})

    return rows(cfg.num_prompts), rows(1)


# ----------------------------------------------------------------------------- the default reward


def table_reward(prompts, completions, completion_ids, rewards, **fields) -> list[float]:
    """The reward of each response from its row's table: rewards[i][t1] for a one-token response,
    rewards[i][t1][t2] for a two-token one (a `reward.function` in the TRL convention)."""
    out = []
    for ids, table in zip(completion_ids, rewards):
        value = table
        for token in ids:
            value = value[token]
        out.append(float(value))
    return out
