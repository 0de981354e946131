"""PPO with a KL penalty on GSM8K-shaped problems, the whole algorithm in one file, to read in a sitting.

    python ppo.py                                     # a few minutes on 2 CPU cores, no network
    python ppo.py --reward-kl none --loss-kl k3+      # the KL in the actor's loss instead of the reward

One step: sample a response to each of 64 problems -> score it by GSM8K's rule (1 for the right `#### N`) ->
the KL to the frozen reference, by any estimator of rlhf.kl, into the reward and/or the loss -> GAE advantages
from the critic -> 2 epochs of clipped PPO updates of the actor and the critic, in mini-batches of 32. It
trains the embedded default (a tiny model warm-started on generated GSM8K-shaped problems, rlhf/embedded.py,
built on first use and cached) with configs/tiny.yaml's settings, and prints greedy held-out accuracy at the
start, every 10 steps and at the end. Everything else is plain torch, transformers and accelerate.

This is the algorithm train.py runs (rlhf/step.py): tests/test_ppo.py hands these functions and the trainer
the same batch, models and settings, and checks that their losses, gradients and weights after an update
agree; it also checks that Args and the optimizers are configs/tiny.yaml's, and runs this loop for two steps.
What this file leaves out, against the trainer:
- critic-free advantages (grpo, rloo) and several responses per prompt (rollout.n); loss aggregations other
  than the token mean; the adaptive KL coefficient; lr schedules;
- micro-batches (a mini-batch is one forward and backward), several processes (DDP, FSDP2), mixed precision,
  the chunked float32 log-softmax and exact KL (here the whole (B, R, V) float32 log-softmax exists at once);
- the speed shortcuts for the old log-probs (the sampler's, or the update's own): here always a forward pass;
  its own decoding loop: this file samples with transformers' `generate`;
- the KL panel (every estimator logged on the same batch) and most metrics, W&B, checkpoints and resuming,
  pass@k, logged samples, the export, skipping non-finite updates, the config's checks, tasks and rewards of
  your own; LoRA adapters (every weight trains here, and the reference is a second model).
"""

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass

import torch
import transformers
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlhf import kl
from rlhf.data import build_prompt
from rlhf.embedded import EmbeddedConfig, prepare_embedded_default
from rlhf.rewards.gsm8k import compute_score, extract_ground_truth


@dataclass
class Args:
    """Every setting (configs/tiny.yaml's values), with the trainer's config key of the same meaning."""

    seed: int = 42  # trainer.seed: the prompt order, sampling, the mini-batches
    total_steps: int = 40  # trainer.total_steps
    batch_size: int = 64  # data.train_batch_size: prompts per step, one response each
    max_response_length: int = 64  # data.max_response_length
    temperature: float = 1.0  # rollout.temperature: sampling, and every log-prob
    actor_lr: float = 5e-5  # actor.lr (AdamW)
    critic_lr: float = 1e-3  # critic.lr
    weight_decay: float = 0.0  # actor.weight_decay and critic.weight_decay (AdamW's; torch's default is 0.01)
    ppo_epochs: int = 2  # actor.ppo_epochs: passes over each batch
    mini_batch_size: int = 32  # actor.ppo_mini_batch_size: one optimizer step per model and mini-batch
    clip_ratio: float = 0.2  # actor.clip_ratio: PPO's epsilon
    clip_ratio_c: float = 3.0  # actor.clip_ratio_c: the dual clip's cap on a negative advantage's loss
    cliprange_value: float = 0.5  # critic.cliprange_value
    grad_clip: float = 1.0  # actor.grad_clip and critic.grad_clip: max gradient norm
    gamma: float = 1.0  # algorithm.gamma: GAE's discount
    lam: float = 1.0  # algorithm.lam: GAE's lambda
    reward_kl: str | None = "k1"  # algorithm.kl_penalty, the estimator in the reward; None: no KL there
    reward_kl_coef: float = 0.01  # algorithm.kl_ctrl.kl_coef (fixed)
    loss_kl: str | None = None  # actor.kl_loss_type, the estimator in the loss; None: no KL loss
    loss_kl_coef: float = 0.001  # actor.kl_loss_coef
    off_policy_correction: bool = False  # actor.kl_loss_off_policy_correction: weight the KL loss by pi/pi_old
    entropy_coeff: float = 0.0  # actor.entropy_coeff: try 0.01 for an entropy bonus
    eval_every: int = 10  # trainer.test_freq: greedy held-out accuracy every N steps
    cache_dir: str = "outputs/cache"  # trainer.cache_dir: where the embedded default is built once


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1 (over `dim`, or all); masked-out entries never count, even NaN."""
    x = torch.where(mask.bool(), x, 0.0)
    return (x.sum() if dim is None else x.sum(dim)) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def load_problems(path, tokenizer):
    """A GSM8K-schema JSONL file -> {"prompt": chat-templated question, "answer": the number after ####}."""
    rows = [json.loads(line) for line in open(path)]
    return {"prompt": [build_prompt(tokenizer, row["question"]) for row in rows],
            "answer": [extract_ground_truth(row["answer"]) for row in rows]}


# ----------------------------------------------------------------------------- rollout: sample, score, passes


def sequences(actor, tokenizer, prompts, max_new_tokens, temperature=None):
    """Sample (temperature) or greedily decode (None) one response per prompt: a batch of tensors, input_ids
    (B, P+R) = left-padded prompt + response, response_ids (B, R), response_mask (B, R): 1 up to and including
    the first end-of-sequence token."""
    inputs = tokenizer(prompts, padding=True, add_special_tokens=False, return_tensors="pt").to(actor.device)
    # No top-k/top-p: the tokens are samples of pi itself, as every KL estimator assumes (the embedded model's
    # generation_config.json sets nothing else; a hub model's may: docs/training.md#sampling).
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    out = actor.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    response_ids = out[:, inputs["input_ids"].shape[1]:]
    is_end = (response_ids == tokenizer.eos_token_id).long()
    response_mask = (is_end.cumsum(1) - is_end == 0).long()  # no end-of-sequence before t
    attention_mask = torch.cat([inputs["attention_mask"], response_mask], dim=1)
    return {"input_ids": out, "attention_mask": attention_mask, "response_ids": response_ids,
            "response_mask": response_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0)}


def score(tokenizer, batch, answers):
    """(B,) GSM8K's strict rule: 1.0 where the response's last `#### N` is the answer, else 0.0."""
    texts = tokenizer.batch_decode(batch["response_ids"], skip_special_tokens=True)  # padded after the end
    return torch.tensor([compute_score(text, answer) for text, answer in zip(texts, answers)])


def forward(model, batch, temperature):
    """The log-probs (B, R) of the response tokens under softmax(logits / temperature), and the whole
    log-softmax (B, R, V) they are read from (at the position before each token)."""
    num_response = batch["response_ids"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -num_response - 1:-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch["response_ids"][..., None])[..., 0], logp


def values_of(critic, batch):
    """(B, R) the critic's value of each state prompt + response[:t]."""
    num_response = batch["response_ids"].shape[1]
    return critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"]).logits[:, -num_response - 1:-1, 0].float()


@torch.no_grad()
def rollout(args, actor, critic, ref, tokenizer, problems):
    """Sample and score one response per problem, then the forward passes at the sampling weights: the old
    log-probs (the actor's), the reference's, the exact per-token KL (for a `full` reward KL), the values."""
    batch = sequences(actor, tokenizer, problems["prompt"], args.max_response_length, args.temperature)
    batch["scores"] = score(tokenizer, batch, problems["answer"])
    batch["old_logprobs"], logp = forward(actor, batch, args.temperature)
    batch["ref_logprobs"], ref_logp = forward(ref, batch, args.temperature)
    batch["full_kl"] = (logp.exp() * (logp - ref_logp)).sum(-1)  # the exact KL(pi || ref) per token: `full`
    batch["values"] = values_of(critic, batch)
    return batch


# ----------------------------------------------------------------------------- rewards and advantages


def advantages_and_returns(args, batch):
    """Token rewards (the score on the last response token, minus reward_kl_coef * KL on every token) ->
    GAE (Schulman et al. 2016) -> advantages whitened over the batch's tokens, and the critic's returns."""
    mask, values = batch["response_mask"], batch["values"]
    rewards = torch.zeros_like(values)
    rewards[torch.arange(len(mask)), mask.sum(1) - 1] = batch["scores"]
    if args.reward_kl:  # detached log-probs: in the reward, `X+` is X
        reward_kl = kl.parse_estimator(args.reward_kl)(batch["old_logprobs"], batch["ref_logprobs"], batch["full_kl"])
        rewards = rewards - args.reward_kl_coef * reward_kl  # past a response's end GAE reads no reward
    advantages, next_value, next_advantage = torch.zeros_like(values), 0.0, 0.0
    for t in reversed(range(values.shape[1])):  # after a response's last token, value and advantage are 0
        delta = rewards[:, t] + args.gamma * next_value - values[:, t]
        next_advantage = torch.where(mask[:, t].bool(), delta + args.gamma * args.lam * next_advantage, 0.0)
        next_value = torch.where(mask[:, t].bool(), values[:, t], 0.0)
        advantages[:, t] = next_advantage
    returns = torch.where(mask.bool(), advantages + values, 0.0)
    valid = advantages[mask.bool()]
    whitened = (advantages - valid.mean()) * torch.rsqrt(valid.var() + 1e-8)  # unbiased variance, as verl
    return torch.where(mask.bool(), whitened, 0.0), returns


# ----------------------------------------------------------------------------- the PPO losses and update


def losses(args, actor, critic, ref, mb):
    """The actor's and the critic's loss on a mini-batch, each a token mean over its response tokens:

        actor:  max(-A * ratio, -A * clip(ratio, 1 +- clip_ratio)), capped at -A * clip_ratio_c where A < 0
                - entropy_coeff * entropy + loss_kl_coef * KL(pi || ref), ratio = pi / pi_old
        critic: 0.5 * max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2)
    """
    mask, A = mb["response_mask"], mb["advantages"]
    logprobs, logp = forward(actor, mb, args.temperature)
    ratio = torch.exp((logprobs - mb["old_logprobs"]).clamp(-20.0, 20.0))
    pg_losses = torch.maximum(-A * ratio, -A * ratio.clamp(1 - args.clip_ratio, 1 + args.clip_ratio))
    pg_losses = torch.where(A < 0, torch.minimum(pg_losses, -A * args.clip_ratio_c), pg_losses)  # dual clip
    actor_loss = masked_mean(pg_losses, mask)
    if args.entropy_coeff:
        actor_loss = actor_loss - args.entropy_coeff * masked_mean(-(logp.exp() * logp).sum(-1), mask)
    if args.loss_kl:
        estimator, full = kl.parse_estimator(args.loss_kl), None
        if estimator.needs_logits:  # the exact KL, differentiated through the actor's logits
            with torch.no_grad():
                ref_logp = forward(ref, mb, args.temperature)[1]
            full = (logp.exp() * (logp - ref_logp)).sum(-1)
        old = mb["old_logprobs"] if args.off_policy_correction else None  # rho = pi / pi_old, docs/kl.md
        kl_per_token = estimator(logprobs, mb["ref_logprobs"], full, old)
        actor_loss = actor_loss + args.loss_kl_coef * masked_mean(kl_per_token, mask)
    values = values_of(critic, mb)
    clipped = values.clamp(mb["values"] - args.cliprange_value, mb["values"] + args.cliprange_value)
    critic_loss = masked_mean(0.5 * torch.maximum((values - mb["returns"]) ** 2, (clipped - mb["returns"]) ** 2), mask)
    return actor_loss, critic_loss


def update(args, actor, critic, ref, optimizers, batch, step):
    """ppo_epochs passes over the batch, each in a fresh random order of mini-batches (drawn from (seed, step),
    as the trainer draws them); per mini-batch, one clipped optimizer step of each model."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    for _ in range(args.ppo_epochs):
        for index in torch.randperm(len(batch["scores"]), generator=generator).split(args.mini_batch_size):
            mb = {key: value[index] for key, value in batch.items()}
            for model, optimizer, loss in zip((actor, critic), optimizers, losses(args, actor, critic, ref, mb)):
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
                optimizer.zero_grad()


# ----------------------------------------------------------------------------- evaluation and the loop


@torch.no_grad()
def accuracy(actor, tokenizer, problems, args, batch_size=128):
    """Greedy accuracy on held-out problems, by the reward's rule."""
    scores = []
    for i in range(0, len(problems["prompt"]), batch_size):
        greedy = sequences(actor, tokenizer, problems["prompt"][i:i + batch_size], args.max_response_length)
        scores.append(score(tokenizer, greedy, problems["answer"][i:i + batch_size]))
    return torch.cat(scores).mean().item()


def optimizers(args, actor, critic):
    """AdamW for the actor and the critic, with the trainer's settings (rlhf.setup.build_optimizers)."""
    return [torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay),
            torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay)]


def main(args, built=None):
    """Train, print, return the actor; `built`: the embedded default's files, else built in args.cache_dir."""
    started = time.perf_counter()
    transformers.logging.set_verbosity_error()  # the critic's load report: its value head is new, by design
    transformers.logging.disable_progress_bar()
    accelerator = Accelerator()
    built = built or prepare_embedded_default(args.cache_dir, EmbeddedConfig())  # minutes the first time
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(built.model_dir, padding_side="left")
    train, val = load_problems(built.train_file, tokenizer), load_problems(built.val_file, tokenizer)
    actor = AutoModelForCausalLM.from_pretrained(built.model_dir, dtype=torch.float32).eval()  # no dropout: ever
    ref = AutoModelForCausalLM.from_pretrained(built.model_dir, dtype=torch.float32).eval().requires_grad_(False)
    # The critic: the policy's backbone with a new value head, zeroed (values start at 0), no dropout before it.
    config = AutoConfig.from_pretrained(built.model_dir, num_labels=1, classifier_dropout=0.0)
    critic = AutoModelForTokenClassification.from_pretrained(built.model_dir, config=config)
    torch.nn.init.zeros_(critic.score.weight)
    actor, critic, *adamw = accelerator.prepare(actor, critic.eval(), *optimizers(args, actor, critic))
    ref = ref.to(accelerator.device)
    print(f"step 0: held-out accuracy {accuracy(actor, tokenizer, val, args):.3f}", flush=True)
    order = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.total_steps + 1):
        index = torch.randperm(len(train["prompt"]), generator=order)[:args.batch_size].tolist()
        problems = {key: [values[i] for i in index] for key, values in train.items()}
        batch = rollout(args, actor, critic, ref, tokenizer, problems)
        batch["advantages"], batch["returns"] = advantages_and_returns(args, batch)
        update(args, actor, critic, ref, adamw, batch, step)
        mask, d = batch["response_mask"], batch["old_logprobs"] - batch["ref_logprobs"]
        print(f"step {step}: score {batch['scores'].mean():.3f}, KL(pi || ref) per token "
              f"{masked_mean(batch['full_kl'], mask):.4f} (its k1 estimate {masked_mean(d, mask):.4f})", flush=True)
        if step % args.eval_every == 0 or step == args.total_steps:
            print(f"step {step}: held-out accuracy {accuracy(actor, tokenizer, val, args):.3f}", flush=True)
    print(f"done: {args.total_steps} steps in {time.perf_counter() - started:.0f} s")
    return actor


def boolean(text):
    """`true` or `false`, as the trainer's config writes them; anything else is refused."""
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text == "true"


def estimator(text):
    """A KL estimator's name (rlhf.kl), or `none`: no KL there."""
    try:
        return None if text == "none" else kl.parse_estimator(text).name
    except ValueError as error:  # an unknown name, with the valid ones
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv=None) -> Args:
    """Every Args field as a flag: --total-steps 10, --loss-kl k3+ (`none` turns a KL off), --entropy-coeff 0.01,
    --off-policy-correction true. A value a flag does not understand stops the run with the valid ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field in dataclasses.fields(Args):
        parse = {bool: boolean, str | None: estimator}.get(field.type, field.type)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=parse, default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse_args())
