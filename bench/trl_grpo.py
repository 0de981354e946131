"""TRL's side of bench/grpo_step.py: `trl.GRPOTrainer` set up for exactly the benchmark's GRPO work, stepped one
iteration of its training loop at a time, with its phases timed and one step checked. Runs against TRL 1.16
(the bench-trl1 extra) and 0.29.1 (the bench extra) alike: every setting is passed explicitly.
"""

from __future__ import annotations

import os
import threading
import time

# bench/common.py first: it sets the environment before torch loads.
from common import (KL_COEF, LR, N, NUM_RESPONSES, RESPONSE_LENGTH, SEED, GenerationClock, count_decode_steps,
                    count_optimizer_steps, forward_batch_sizes, load_group_workload, sync)

import torch


def gsm8k_reward(completions, ground_truth, **kwargs) -> list[float]:
    """TRL reward function: our GSM8K rule on the decoded completions (as `rlhf.rewards.score_batch`)."""
    from rlhf.config import DataConfig
    from rlhf.rewards.gsm8k import compute_score

    method = DataConfig().reward_method  # "strict", what our side uses
    return [compute_score(text, truth, method=method) for text, truth in zip(completions, ground_truth)]


class TRLGRPOSide:
    """TRL's GRPOTrainer, set up for exactly the workload (`gpu`: bf16); `step()` runs one iteration of its
    training loop. `trainer.train()` runs in a helper thread with a huge max_steps; a callback parks it at every
    `on_step_end` (and at `on_train_begin`) until `step()` releases it. Only one thread runs at a time."""

    name = "TRL GRPOTrainer"

    def __init__(self, workdir: str, gpu: bool):
        from datasets import Dataset
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOConfig, GRPOTrainer

        from rlhf.models import load_causal_lm

        model_dir, tokenizer, prompts = load_group_workload(workdir)
        # TRL takes text prompts and tokenizes them itself: the chat-templated text of ours, checked to
        # tokenize back to exactly our token ids.
        texts = [tokenizer.decode(ids) for ids in prompts["input_ids"]]
        assert tokenizer(text=texts)["input_ids"] == prompts["input_ids"], "TRL would see other prompt tokens"
        torch.manual_seed(SEED)
        self.policy = load_causal_lm(model_dir)
        args = GRPOConfig(
            output_dir=os.path.join(workdir, "trl-grpo"), report_to="none", seed=SEED,
            # 32 completions = 8 prompts x 4 per generation and per optimizer step, one forward/backward.
            per_device_train_batch_size=NUM_RESPONSES, gradient_accumulation_steps=1, steps_per_generation=1,
            num_generations=N, num_iterations=1,
            # EOS is masked out while sampling, so every completion is exactly 64 tokens (eos_token_id=None
            # does not work: transformers refills it from the generation config).
            max_completion_length=RESPONSE_LENGTH, generation_kwargs={"min_new_tokens": RESPONSE_LENGTH},
            temperature=1.0, top_p=1.0, top_k=0,
            # k3 times the importance ratio (value 1, gradient that of the log-prob): on-policy, k3+'s gradient.
            beta=KL_COEF, use_bias_correction_kl=True, epsilon=0.2, loss_type="dapo", scale_rewards="group",
            mask_truncated_completions=False, sync_ref_model=False, disable_dropout=True,
            learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            optim="adamw_torch_fused",
            # TRL's configs default to bf16 and activation checkpointing on. (`gradient_checkpointing` is a
            # deprecated alias in transformers 5: the new name set to False turns both off.)
            bf16=gpu, fp16=False, activation_checkpointing=False,
            max_steps=10**9, save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True,
            log_completions=False, dataloader_num_workers=0,
        )
        self.trainer = GRPOTrainer(
            model=self.policy, reward_funcs=gsm8k_reward, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": texts, "ground_truth": prompts["ground_truth"]}),
        )
        for callback in (PrinterCallback, ProgressCallback):  # printing is not part of the work
            self.trainer.remove_callback(callback)
        self.gen_clock = GenerationClock(self.policy, "generate")
        self.phases: dict[str, float] = {}
        self._clock_phases()

        self._go, self._done, self._ready = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
        self._stopping, self._error = False, None
        self.begin = self.end = 0.0
        self.last_metrics: dict[str, float] = {}
        side = self

        class Parking(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                side._ready.set()  # set-up done (optimizer built): the constructor may return
                side._park()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                side.end = time.perf_counter()
                side.last_metrics = {k: v[-1] for k, v in side.trainer._metrics["train"].items() if v}
                side._done.release()
                side._park()
                if side._stopping:
                    control.should_training_stop = True
                return control

        self.trainer.add_callback(Parking())
        self._thread = threading.Thread(target=self._train, name="trl-grpo-train", daemon=True)
        self._thread.start()
        while not self._ready.wait(timeout=5.0):  # so that nothing else runs alongside TRL's set-up
            if not self._thread.is_alive():
                raise RuntimeError("TRL's training thread stopped during set-up") from self._error

    def _clock_phases(self) -> None:
        """Time TRL's rollout (`_prepare_inputs`) and its scoring forwards without grad (reference, old
        policy), synchronised, into `phases`; instance attributes shadow the methods the trainer calls."""
        trainer = self.trainer
        prepare, logps = trainer._prepare_inputs, trainer._get_per_token_logps_and_entropies

        def clocked(key, fn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                self.phases[key] = self.phases.get(key, 0.0) + time.perf_counter() - start

        def timed_logps(model, *args, **kwargs):
            if torch.is_grad_enabled():  # the loss's forward: part of the update
                return logps(model, *args, **kwargs)
            key = "ref" if model is trainer.ref_model else "old_log_prob"
            return clocked(key, logps, model, *args, **kwargs)

        trainer._prepare_inputs = lambda *a, **k: clocked("rollout", prepare, *a, **k)
        trainer._get_per_token_logps_and_entropies = timed_logps

    def _park(self) -> None:
        """In the training thread: wait for `step()` (or `close()`), then start the clock."""
        self._go.acquire()
        self.begin = time.perf_counter()

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as e:  # re-raised in the main thread by step()
            self._error = e
        finally:
            self._done.release()

    def describe(self) -> str:
        opt = self.trainer.optimizer.optimizer  # built before on_train_begin, which the constructor waits for
        return f"{type(opt).__name__}(fused={opt.defaults.get('fused')}) over the policy"

    def step(self) -> dict[str, float]:
        """One iteration of TRL's loop: {"step", "gen_synced", and our timer's phase names: "gen", "ref",
        "old_log_prob" (0 on-policy), "update" (the step after the rollout: loss, backward, optimizer, Trainer
        loop)}; what is left of the step is the rest of the rollout (reward, advantages, text, gathering)."""
        self.gen_clock.seconds, self.phases = 0.0, {}
        self._go.release()
        while not self._done.acquire(timeout=5.0):
            if not self._thread.is_alive():
                break
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError("TRL's training thread stopped") from self._error
        step, gen, p = self.end - self.begin, self.gen_clock.seconds, self.phases
        return {"step": step, "gen_synced": gen, "gen": gen, "ref": p.get("ref", 0.0),
                "old_log_prob": p.get("old_log_prob", 0.0), "update": step - p["rollout"]}

    def close(self) -> None:
        if self._thread.is_alive():
            self._stopping = True
            self._go.release()
            self._thread.join(timeout=120)

    def check(self) -> dict:
        """One step: RESPONSE_LENGTH decoding steps, one optimizer step, NUM_RESPONSES sequences in every
        policy forward, every completion RESPONSE_LENGTH tokens, the bias-corrected KL in the loss, no
        old-policy forward."""
        decode_steps, optimizer_steps, sizes = [], [], []
        with count_decode_steps(self.policy, "generate", self.policy, decode_steps), \
                count_optimizer_steps([self.trainer.optimizer.optimizer], optimizer_steps), \
                forward_batch_sizes(self.policy, sizes):
            seconds = self.step()
        assert decode_steps == [RESPONSE_LENGTH], f"TRL ran {decode_steps} decoding steps, not [{RESPONSE_LENGTH}]"
        assert optimizer_steps == [1], f"TRL took {optimizer_steps} optimizer steps"
        assert set(sizes) == {NUM_RESPONSES}, f"TRL: policy forwards of batch sizes {sorted(set(sizes))}"
        m = self.last_metrics
        lengths = (m.get("completions/min_length"), m.get("completions/max_length"))
        assert lengths == (RESPONSE_LENGTH, RESPONSE_LENGTH), f"TRL's completions have lengths {lengths}"
        assert "kl" in m and self.trainer.ref_model is not None, "TRL computed no KL (beta 0?)"
        assert self.trainer.args.use_bias_correction_kl and seconds["old_log_prob"] == 0.0
        assert not (self.trainer.args.gradient_checkpointing or self.trainer.args.activation_checkpointing)
        return {"policy_forwards": len(sizes), "optimizer_steps": optimizer_steps}
