"""Sampling and the forward passes: tokens are true samples of pi, our decoding loop makes the same passes
as transformers' `generate`, and the log-probs the trainer computes are those of the distribution the
tokens were sampled from (left padding included)."""

import dataclasses
import math

import pytest
import torch
from helpers import tiny_qwen2
from transformers import GenerationConfig

from rlhf.step import logprob_mismatch, logprobs_and_logits
from rlhf.rollout import (SamplingParams, Sequences, generate, left_pad, next_token,
                          response_mask_from_ids)

EOS, PAD = 1, 0


class FakeTokenizer:
    pad_token_id, eos_token_id = PAD, EOS


def tiny_model(vocab_size=512, seed=0):
    """helpers.tiny_qwen2 with this file's token ids and tied embeddings."""
    return tiny_qwen2(vocab_size, seed, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)


def test_sampling_is_not_top_k_truncated():
    """A near-uniform random model over 512 tokens: 2048 draws of one token hit far more than 50 distinct
    tokens. A hidden top-k (transformers' generate turns `top_k=None` into 50) would cap it at 50."""
    model = tiny_model()
    prompts = torch.full((2048, 3), 7)
    torch.manual_seed(0)
    batch = generate(model, FakeTokenizer, prompts, torch.ones_like(prompts), SamplingParams(max_new_tokens=1))
    assert batch.response_ids[:, 0].unique().numel() > 200


def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9], [EOS, 3, 3, 3, 3]])
    assert response_mask_from_ids(ids, EOS).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_ignore_eos_samples_every_token():
    model = tiny_model(vocab_size=4)  # EOS is one token in four: it would stop early almost surely
    prompts = torch.full((8, 2), 2)
    torch.manual_seed(0)
    batch = generate(model, FakeTokenizer, prompts, torch.ones_like(prompts),
                     SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert batch.response_ids.shape == (8, 12)
    assert batch.response_mask.all()
    assert (batch.response_ids == EOS).any()  # EOS was sampled, and generation went on


def hf_config(**kwargs) -> GenerationConfig:
    """transformers' generate, told everything (top_k=0, not None: None means its default of 50)."""
    return GenerationConfig(pad_token_id=PAD, repetition_penalty=1.0, top_k=0, top_p=1.0, **kwargs)


def test_greedy_decoding_equals_transformers_generate():
    """Same passes as model.generate: left padding, KV cache, position ids and stopping at EOS included.
    An untied, large-init model, so greedy output varies along the sequence instead of repeating."""
    model = tiny_qwen2(16, seed=2, pad_token_id=PAD, tie_word_embeddings=False, initializer_range=0.5)
    prompt_ids, prompt_mask = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]], PAD)
    lengths = {}
    for eos in (13, 1, 10):
        tokenizer = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": eos})
        ours = generate(model, tokenizer, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=20, greedy=True))
        theirs = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                generation_config=hf_config(do_sample=False, max_new_tokens=20, eos_token_id=eos))
        theirs = theirs[:, prompt_ids.shape[1]:]
        mask = response_mask_from_ids(theirs, eos)
        expected = torch.nn.functional.pad(torch.where(mask.bool(), theirs, PAD), (0, 20 - theirs.shape[1]), value=PAD)
        assert torch.equal(ours.response_ids, expected)  # argmax tokens: the same passes, the same shapes
        assert torch.equal(ours.response_mask.sum(dim=1), mask.sum(dim=1))
        lengths[eos] = mask.sum(dim=1).tolist()
    # The cases cover: every row stopping (so the loop ends early), and some rows stopping while others run on.
    assert max(lengths[13]) < 20 and min(lengths[1]) < 20 == max(lengths[1])
    assert len(set(lengths[10])) == 4, lengths


def within_sigmas(counts: torch.Tensor, probs: torch.Tensor, sigmas: float = 5.0) -> bool:
    """Every empirical frequency is within `sigmas` binomial standard deviations of its probability."""
    n = counts.sum()
    sd = (probs * (1 - probs) / n).sqrt().clamp(min=1 / n)
    return bool(((counts / n - probs).abs() <= sigmas * sd).all())


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 3, 1.0), (1.5, 0, 0.7)])
def test_next_token_samples_exactly_from_the_filtered_softmax(temperature, top_k, top_p):
    """200,000 draws from fixed logits over 6 tokens: frequencies within 5 binomial standard deviations of
    softmax(logits / T) after top-k/top-p (their definitions, written out here), and tokens filtered out
    never drawn. Seeded, so it cannot flake."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(0)
    draws = next_token(logits.expand(200_000, -1), params)
    counts = torch.bincount(draws, minlength=6).double()

    warped = logits / temperature
    if top_k:  # keep the k largest
        warped = warped.masked_fill(warped < warped.topk(top_k).values[-1], -math.inf)
    if top_p < 1.0:  # keep the smallest set of largest tokens whose probability reaches top_p
        probs = torch.softmax(warped, dim=-1)
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        warped = warped.clone()
        warped[order[mass_before >= top_p]] = -math.inf
    probs = torch.softmax(warped.double(), dim=-1)
    assert within_sigmas(counts, probs)
    assert (counts[probs == 0] == 0).all()
    if top_k or top_p < 1.0:
        assert (probs == 0).any()  # the filter did remove tokens in this case


def test_next_token_detects_a_wrong_distribution():
    """The frequency check above has power: draws at temperature 1 fail it against temperature 0.9."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    torch.manual_seed(0)
    draws = next_token(logits.expand(200_000, -1), SamplingParams(max_new_tokens=1))
    counts = torch.bincount(draws, minlength=6).double()
    assert within_sigmas(counts, torch.softmax(logits.double(), -1))
    assert not within_sigmas(counts, torch.softmax(logits.double() / 0.9, -1))


def test_sampled_sequences_follow_the_model_at_every_step():
    """Multi-token sampling through the KV cache with left padding: over 20,000 sequences of 2 tokens, the
    second token's frequencies given the first match the model's conditional probabilities."""
    model = tiny_model(vocab_size=4, seed=5)
    prompts = [[2, 3, 2], [3]] * 10_000
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    torch.manual_seed(1)
    batch = generate(model, FakeTokenizer, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=2, ignore_eos=True))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                           position_ids=batch.position_ids).logits.double(), -1)
    width = prompt_ids.shape[1]
    for row in (0, 1):  # the long and the short (left-padded) prompt
        rows = torch.arange(row, len(prompts), 2)
        first = batch.response_ids[rows, 0]
        token = torch.mode(first).values  # condition on the most frequent first token
        chosen = rows[first == token]
        counts = torch.bincount(batch.response_ids[chosen, 1], minlength=4).double()
        probs = logprobs[chosen[0], width].exp()  # p(second token | prompt, first token)
        assert within_sigmas(counts, probs)


def test_trainer_logprobs_match_the_sampling_distribution_with_left_padding():
    """Log-probs recomputed by a full forward (as for old/ref log-probs) equal those of the distribution
    transformers' incremental decoding samples from, for prompts of different lengths (position ids over
    real tokens only)."""
    model = tiny_model(vocab_size=64)
    prompt_ids, prompt_mask = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]], PAD)
    temperature = 0.7
    config = hf_config(do_sample=True, temperature=temperature, max_new_tokens=6, eos_token_id=[])
    torch.manual_seed(0)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                         output_scores=True, return_dict_in_generate=True)
    response = out.sequences[:, prompt_ids.shape[1]:]
    scores = torch.stack(out.scores, dim=1)  # (B, R, V): logits after the temperature warper
    expected = torch.log_softmax(scores.float(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)

    batch = Sequences.build(prompt_ids, prompt_mask, response, torch.ones_like(response))
    with torch.no_grad():
        logprobs, logits = logprobs_and_logits(model, batch, temperature)
    assert logits.shape == (3, 6, 64)
    torch.testing.assert_close(logprobs, expected, rtol=1e-4, atol=1e-4)


def paired_sample(model, prompts, seed=42, step=3, process_index=0, max_new_tokens=6):
    from rlhf.rollout import paired_noise_generator

    torch.manual_seed(torch.randint(0, 10**6, ()).item())  # the global random state must not matter
    return generate(model, FakeTokenizer, prompts, torch.ones_like(prompts), SamplingParams(max_new_tokens),
                    generator=paired_noise_generator(seed, step, process_index, "cpu")).response_ids


def test_paired_noise_gives_the_same_samples_for_the_same_seed_step_and_process():
    model = tiny_model(vocab_size=64)
    prompts = torch.randint(2, 64, (16, 3), generator=torch.Generator().manual_seed(0))
    first = paired_sample(model, prompts)
    assert torch.equal(first, paired_sample(model, prompts))
    # another step, another seed or another process draws other noise: with 64 tokens, most samples differ
    for other in (dict(step=4), dict(seed=43), dict(process_index=1)):
        assert (paired_sample(model, prompts, **other) != first).float().mean() > 0.5, other


def test_paired_noise_keeps_a_row_s_samples_where_the_policies_agree():
    """Common random numbers: rows whose distributions are unchanged keep their samples even when another
    row's distribution (here: its prompt) changes, so two runs differ only where their policies do. A
    large-init model, so that another prompt really is another distribution."""
    model = tiny_qwen2(64, 0, pad_token_id=PAD, eos_token_id=EOS, initializer_range=1.0)
    prompts = torch.randint(2, 64, (8, 3), generator=torch.Generator().manual_seed(1))
    changed = prompts.clone()
    changed[5] = (changed[5] + 7) % 62 + 2
    a, b = paired_sample(model, prompts), paired_sample(model, changed)
    keep = [i for i in range(8) if i != 5]
    assert torch.equal(a[keep], b[keep])  # exact: same shapes, and a row's logits never involve another row's
    assert not torch.equal(a[5], b[5])


def test_every_eos_id_of_the_generation_config_ends_a_response_and_a_sampled_pad_id_does_not():
    """A model whose generation config lists two EOS ids (as Qwen2.5-Instruct's: <|im_end|>, <|endoftext|>),
    the second also the pad id, and a tokenizer whose EOS is only the first. Greedy decoding (so the tokens are
    known) from an untied large-init model: the second id ends the rows that produce it, masked after its
    first occurrence; a pad id that is not an EOS is a response token like any other."""
    from rlhf.rollout import stop_token_ids

    model = tiny_qwen2(16, seed=2, pad_token_id=PAD, tie_word_embeddings=False, initializer_range=0.5)
    prompt_ids, prompt_mask = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]], PAD)
    free = generate(model, type("Tok", (), {"pad_token_id": 15, "eos_token_id": 14}), prompt_ids, prompt_mask,
                    SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)).response_ids
    row0 = free[0].tolist()  # the first token of row 0 that is new there: declared the second EOS and the pad id
    at = next(t for t in range(1, 11) if row0[t] not in row0[:t] and row0[t] != 14)
    second = row0[at]
    model.generation_config.eos_token_id = [14, second]
    tokenizer = type("Tok", (), {"pad_token_id": second, "eos_token_id": 14})
    assert stop_token_ids(model, tokenizer) == (14, second)
    out = generate(model, tokenizer, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=12, greedy=True))
    for row in range(4):
        tokens = free[row].tolist()
        end = next((t for t, tok in enumerate(tokens) if tok in (14, second)), len(tokens) - 1)
        assert out.response_mask[row].tolist() == [1] * (end + 1) + [0] * (len(tokens) - end - 1)
        assert out.response_ids[row, : end + 1].tolist() == tokens[: end + 1]
    assert out.response_mask[0].sum() == at + 1

    # the pad id sampled mid-response, and not an EOS: the response goes on through it
    pad_only = type("Tok", (), {"pad_token_id": second, "eos_token_id": 14})
    model.generation_config.eos_token_id = None
    kept = generate(model, pad_only, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=12, greedy=True))
    assert kept.response_ids[0, at] == second and kept.response_mask[0, : at + 2].tolist() == [1] * (at + 2)


def test_sampler_logprobs_are_those_of_the_unfiltered_distribution_at_the_temperature():
    """SamplingParams.keep_logprobs: each sampled token's log-prob under softmax(logits / T) before top-k (the same
    quantity the trainer's forward computes: equal to float rounding, in float32), 0 after the response;
    not the top-k-renormalised log-prob the token was drawn with."""
    model = tiny_model(vocab_size=64)
    prompt_ids, prompt_mask = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]] * 4, PAD)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=5, keep_logprobs=True)
    torch.manual_seed(0)
    batch = generate(model, FakeTokenizer, prompt_ids, prompt_mask, params)
    mask = batch.response_mask.bool()
    assert not mask.all()  # some responses ended at an EOS
    with torch.no_grad():
        logprobs, logits = logprobs_and_logits(model, batch, 0.7)
    torch.testing.assert_close(batch.logprobs[mask], logprobs[mask], rtol=0, atol=1e-5)
    assert (batch.logprobs[~mask] == 0).all()
    top5 = (logits / 0.7).topk(5, dim=-1).values.logsumexp(-1)  # the normaliser over the top-k alone
    renormalised = logits.gather(-1, batch.response_ids[..., None])[..., 0] / 0.7 - top5
    assert (batch.logprobs[mask] < renormalised[mask] - 1e-3).all()
    unkept = dataclasses.replace(params, keep_logprobs=False)
    assert generate(model, FakeTokenizer, prompt_ids, prompt_mask, unkept).logprobs is None


def test_logprob_mismatch_is_k3_over_valid_tokens_and_the_largest_difference():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    recomputed = torch.tensor([[-1.0, -2.1, -2.8], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # the large differences of row 1 are padding
    d = torch.tensor([0.0, 0.1, -0.2, 0.0])  # rollout - recomputed on the valid tokens
    metrics = logprob_mismatch(rollout, recomputed, mask)
    assert metrics["rollout/logprob_mismatch_kl"] == pytest.approx((torch.exp(-d) - 1 + d).mean().item())
    assert metrics["rollout/logprob_abs_diff/max"] == pytest.approx(0.2)
    assert logprob_mismatch(rollout, rollout, mask) == {"rollout/logprob_mismatch_kl": 0.0,
                                                        "rollout/logprob_abs_diff/max": 0.0}
