"""The floors of the benchmarks: the model passes of one step on the workload, done bare (plain torch +
transformers, no accelerate, no metrics), what our trainer's step is compared with.

`FloorSide`, bench/ppo_step.py's: RESPONSE_LENGTH tokens sampled with a bare KV-cache loop (one forward per
token, `torch.multinomial`); the old-policy, reference and critic forwards without grad; two mini-batches of
actor and critic forward+backward with the simplest losses, each followed by a fused AdamW step per model.

`GroupFloorSide`, bench/grpo_step.py's: the passes of an exactly on-policy GRPO step with a KL loss, as TRL's
GRPOTrainer and ours (actor.recompute_old_logprobs=auto) run them: the GROUP_PROMPTS prompts x N sampled with
the same loop, the reference forward without grad, one forward+backward of the actor over all NUM_RESPONSES
sequences and one fused AdamW step. No old-policy forward (the update's own log-probs are the old ones) and
no critic.
"""

from __future__ import annotations

import time

# bench/common.py first: it sets the environment before torch loads.
from common import LR, MINI_BATCH, N, RESPONSE_LENGTH, SEED, load_group_workload, load_workload, sync

import torch


class FloorSide:
    """The model passes of one PPO step, done bare: plain torch + transformers, no metrics, no accelerate
    (`gpu`: under bf16 autocast, as accelerate's mixed precision runs the other sides)."""

    name = "floor (bare passes)"

    def __init__(self, workdir: str, gpu: bool):
        model_dir, tokenizer, prompts = load_workload(workdir)
        self._load(model_dir, tokenizer, prompts["input_ids"], gpu, with_critic=True)

    def _load(self, model_dir: str, tokenizer, rows: list[list[int]], gpu: bool, with_critic: bool) -> None:
        """The models (`with_critic`: and the critic), their fused AdamW and the left-padded prompt rows."""
        from rlhf.models import load_causal_lm, load_critic
        from rlhf.decode import kv_cache_name
        from rlhf.rollout import left_pad

        torch.manual_seed(SEED)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # where accelerate puts the other sides
        self.bf16 = gpu
        self.actor = load_causal_lm(model_dir).eval().to(self.device)
        self.critic = load_critic(model_dir).eval().to(self.device) if with_critic else None
        self.ref = load_causal_lm(model_dir).eval().requires_grad_(False).to(self.device)
        self.cache_name = kv_cache_name(self.actor)  # `past_key_values` or, from transformers 5.24, `cache`
        # The fastest AdamW on this device, as the trainer and TRL's side use.
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.critic_opt = (torch.optim.AdamW(self.critic.parameters(), lr=LR, weight_decay=0.0, fused=True)
                           if with_critic else None)
        self.prompt_ids, self.prompt_mask = (t.to(self.device) for t in left_pad(rows, tokenizer.pad_token_id))

    def _sample(self):
        """(B, P+R): RESPONSE_LENGTH tokens sampled through the KV cache, one forward per token."""
        from rlhf.decode import position_ids_from_mask

        ids, mask = self.prompt_ids, self.prompt_mask
        positions = position_ids_from_mask(mask)
        out = self.actor(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        tokens = []
        for t in range(RESPONSE_LENGTH):
            tokens.append(torch.multinomial(torch.softmax(out.logits[:, -1].float(), dim=-1), 1))  # (B, 1)
            if t + 1 < RESPONSE_LENGTH:
                mask = torch.cat([mask, torch.ones_like(tokens[-1])], dim=1)
                out = self.actor(input_ids=tokens[-1], attention_mask=mask, position_ids=positions[:, -1:] + t + 1,
                                 use_cache=True, **{self.cache_name: getattr(out, self.cache_name)})
        return torch.cat([ids, *tokens], dim=1)

    def _logprobs(self, model, inputs, response_ids):
        logits = model(**inputs, logits_to_keep=RESPONSE_LENGTH + 1, use_cache=False).logits[:, :-1]  # (B, R, V)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)

    def step(self) -> dict[str, float]:
        clock = [time.perf_counter()]
        seconds = {}

        def lap(name):  # phase times, for comparison with our trainer's
            sync()
            clock.append(time.perf_counter())
            seconds[name] = clock[-1] - clock[-2]

        # bf16 autocast over float32 weights with --gpu, as accelerate's mixed precision does.
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.bf16):
            self._passes(lap)
        return {"step": clock[-1] - clock[0], **seconds}

    def _passes(self, lap) -> None:
        from rlhf.decode import position_ids_from_mask

        with torch.no_grad():
            sequences = self._sample()  # (B, P+R)
            lap("gen")
            response_ids = sequences[:, self.prompt_ids.shape[1]:]  # (B, R)
            attention_mask = torch.cat([self.prompt_mask, torch.ones_like(response_ids)], dim=1)
            inputs = dict(input_ids=sequences, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask))
            self._logprobs(self.actor, inputs, response_ids)
            lap("old_log_prob")
            self._logprobs(self.ref, inputs, response_ids)
            lap("ref")
            self.critic(**inputs, use_cache=False)
            lap("values")
        for index in torch.arange(len(sequences), device=self.device).split(MINI_BATCH):
            mini = {k: v[index] for k, v in inputs.items()}
            (-self._logprobs(self.actor, mini, response_ids[index]).mean()).backward()
            values = self.critic(**mini, use_cache=False).logits[:, -RESPONSE_LENGTH - 1:-1, 0]  # (b, R)
            values.square().mean().backward()
            for opt in (self.actor_opt, self.critic_opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
        lap("update")


class GroupFloorSide(FloorSide):
    """The model passes of one on-policy GRPO step with a KL loss, done bare (see the module docstring): the
    sampling loop and `_logprobs` of `FloorSide`, without its critic and old-policy forward."""

    def __init__(self, workdir: str, gpu: bool):
        model_dir, tokenizer, prompts = load_group_workload(workdir)
        rows = [ids for ids in prompts["input_ids"] for _ in range(N)]  # each prompt's group, side by side
        self._load(model_dir, tokenizer, rows, gpu, with_critic=False)

    def _passes(self, lap) -> None:
        from rlhf.decode import position_ids_from_mask

        with torch.no_grad():
            sequences = self._sample()  # (B, P+R), B = NUM_RESPONSES
            lap("gen")
            response_ids = sequences[:, self.prompt_ids.shape[1]:]  # (B, R)
            attention_mask = torch.cat([self.prompt_mask, torch.ones_like(response_ids)], dim=1)
            inputs = dict(input_ids=sequences, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask))
            self._logprobs(self.ref, inputs, response_ids)  # (B, R)
            lap("ref")
        (-self._logprobs(self.actor, inputs, response_ids).mean()).backward()
        self.actor_opt.step()
        self.actor_opt.zero_grad(set_to_none=True)
        lap("update")
