"""Policy, critic and tokenizer loading by local path (the same code path as a hub name)."""

import pytest
import torch

from rlhf.embedded import EmbeddedConfig, build_model, generate_problems, train_tokenizer
from rlhf.models import critic_values, load_causal_lm, load_critic, load_tokenizer, resolve_dtype

CFG = EmbeddedConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen2 causal LM and its tokenizer, written with save_pretrained."""
    path = str(tmp_path_factory.mktemp("model"))
    problems = generate_problems(64, seed=0)
    tokenizer = train_tokenizer(["user", "assistant"] + [p["question"] + " " + p["answer"] for p in problems], 300)
    torch.manual_seed(0)
    model = build_model(CFG, tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _batch(tokenizer, texts):
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def test_load_tokenizer_pads_left_and_falls_back_to_eos(model_dir, tmp_path):
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<|endoftext|>"
    input_ids, attention_mask = _batch(tokenizer, ["Tom has 3 apples.", "Hi"])
    assert attention_mask[1, 0] == 0 and attention_mask[1, -1] == 1  # the short row is padded on the left

    no_pad = train_tokenizer(["some text 123"], 300)
    no_pad.pad_token = None
    no_pad.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_policy_round_trips_through_save_pretrained(model_dir, tmp_path):
    tokenizer = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir).eval()
    input_ids, attention_mask = _batch(tokenizer, ["Tom has 3 apples.", "Anna has 12 books. She sells 4."])
    logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
    policy.save_pretrained(str(tmp_path))
    again = load_causal_lm(str(tmp_path)).eval()
    assert torch.equal(again(input_ids=input_ids, attention_mask=attention_mask).logits, logits)
    assert next(load_causal_lm(model_dir, "bfloat16").parameters()).dtype == torch.bfloat16


def test_critic_shares_the_backbone_and_starts_at_zero(model_dir):
    tokenizer = load_tokenizer(model_dir)
    policy, critic = load_causal_lm(model_dir), load_critic(model_dir)
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, critic.model.get_parameter(name)), name
    input_ids, attention_mask = _batch(tokenizer, ["Tom has 3 apples.", "Anna has 12 books. She sells 4."])
    values = critic_values(critic, input_ids, attention_mask)
    assert values.shape == input_ids.shape and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_critic_values_ignore_dropout_and_left_padding(model_dir):
    tokenizer = load_tokenizer(model_dir)
    critic = load_critic(model_dir)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight)  # a trained-looking head, so values are not all zero
    short, long = "Tom has 3 apples.", "Anna has 12 books. She sells 4. How many books does Anna have now?"
    input_ids, attention_mask = _batch(tokenizer, [short, long])
    critic.train()
    values = critic_values(critic, input_ids, attention_mask)
    assert torch.equal(values, critic_values(critic, input_ids, attention_mask))  # no dropout noise
    critic.eval()
    alone_ids, alone_mask = _batch(tokenizer, [short])
    alone = critic_values(critic, alone_ids, alone_mask)
    num_pad = int((attention_mask[0] == 0).sum())
    assert num_pad > 0
    torch.testing.assert_close(values[0, num_pad:], alone[0], rtol=1e-4, atol=1e-4)


def test_critic_values_are_float32_for_a_bfloat16_critic(model_dir):
    tokenizer = load_tokenizer(model_dir)
    critic = load_critic(model_dir, "bfloat16")
    assert critic.score.weight.dtype == torch.bfloat16
    input_ids, attention_mask = _batch(tokenizer, ["Tom has 3 apples."])
    assert critic_values(critic, input_ids, attention_mask).dtype == torch.float32


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        resolve_dtype("fp8")
