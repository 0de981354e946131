"""Sampling and the forward passes: tokens are true samples of pi, and the log-probs the trainer computes
are those of the distribution the tokens were sampled from (left padding included)."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.rollout import generate, left_pad, logprobs_and_logits, response_mask_from_ids, sampling_config

EOS, PAD = 1, 0


class FakeTokenizer:
    pad_token_id, eos_token_id = PAD, EOS


def tiny_model(vocab_size=512, seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def test_sampling_is_not_top_k_truncated():
    """A near-uniform random model over 512 tokens: 2048 draws of one token hit far more than 50 distinct
    tokens. transformers' default top_k=50 (what `top_k=None` silently gives) caps it at 50."""
    model = tiny_model()
    prompts = torch.full((2048, 3), 7)
    torch.manual_seed(0)
    batch = generate(model, FakeTokenizer, prompts, torch.ones_like(prompts),
                     sampling_config(FakeTokenizer, max_new_tokens=1, temperature=1.0))
    assert batch["response_ids"][:, 0].unique().numel() > 200


def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9], [EOS, 3, 3, 3, 3]])
    assert response_mask_from_ids(ids, EOS).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_ignore_eos_samples_every_token():
    model = tiny_model(vocab_size=4)  # EOS is one token in four: it would stop early almost surely
    prompts = torch.full((8, 2), 2)
    torch.manual_seed(0)
    batch = generate(model, FakeTokenizer, prompts, torch.ones_like(prompts),
                     sampling_config(FakeTokenizer, max_new_tokens=12, ignore_eos=True))
    assert batch["response_ids"].shape == (8, 12)
    assert batch["response_mask"].all()
    assert (batch["response_ids"] == EOS).any()  # EOS was sampled, and generation went on


def test_trainer_logprobs_match_the_sampling_distribution_with_left_padding():
    """Log-probs recomputed by a full forward (as for old/ref log-probs) equal those of the distribution
    generate() sampled from, for prompts of different lengths (position ids over real tokens only)."""
    model = tiny_model(vocab_size=64)
    prompt_ids, prompt_mask = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]], PAD)
    temperature = 0.7
    config = sampling_config(FakeTokenizer, max_new_tokens=6, temperature=temperature, ignore_eos=True)
    torch.manual_seed(0)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                         output_scores=True, return_dict_in_generate=True)
    response = out.sequences[:, prompt_ids.shape[1]:]
    scores = torch.stack(out.scores, dim=1)  # (B, R, V): logits after the temperature warper
    expected = torch.log_softmax(scores.float(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)

    from rlhf.rollout import build_batch
    batch = build_batch(prompt_ids, prompt_mask, response, torch.ones_like(response))
    with torch.no_grad():
        logprobs, logits = logprobs_and_logits(model, batch, temperature)
    assert logits.shape == (3, 6, 64)
    torch.testing.assert_close(logprobs, expected, rtol=1e-4, atol=1e-4)
