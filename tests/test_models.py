"""Policy, critic and tokenizer loading by local path (the same code path as a hub name)."""

import logging
import warnings

import pytest
import torch

from rlhf.embedded import EmbeddedConfig
from rlhf.embedded import build_model, generate_problems, train_tokenizer
from rlhf.models import load_causal_lm, load_critic, load_tokenizer, resolve_dtype
from rlhf.rollout import Sequences, left_pad
from rlhf.step import response_values

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


def _rollout_batch(tokenizer, prompts, responses):
    """A rollout batch as the trainer builds it: left-padded prompts, right-padded responses."""
    prompt_ids, prompt_mask = left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_token_id)
    encoded = [tokenizer.encode(r) for r in responses]
    width = max(len(r) for r in encoded)
    response_ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    response_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, r in enumerate(encoded):
        response_ids[i, :len(r)], response_mask[i, :len(r)] = torch.tensor(r), 1
    return Sequences.build(prompt_ids, prompt_mask, response_ids, response_mask)


def test_critic_shares_the_backbone_and_starts_at_zero(model_dir):
    tokenizer = load_tokenizer(model_dir)
    policy, critic = load_causal_lm(model_dir), load_critic(model_dir)
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, critic.model.get_parameter(name)), name
    batch = _rollout_batch(tokenizer, ["Tom has 3 apples.", "Anna has 12 books. She sells 4."], [" 3", " 8 #### 8"])
    values = response_values(critic, batch)
    assert values.shape == batch.response_ids.shape and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_a_critic_from_a_causal_lm_loads_without_the_load_report_unless_more_is_off(model_dir, tmp_path):
    """The value head is new and the LM head unused, at every start of a run with a critic: transformers' load
    report lists exactly those, so load_critic holds it back; a checkpoint missing a backbone weight is warned
    about, by name."""
    torch.manual_seed(0)
    untied = build_model(CFG, load_tokenizer(model_dir))
    untied.config.tie_word_embeddings = False  # a separate lm_head.weight in the checkpoint, as Qwen2.5-7B's
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    untied.save_pretrained(tmp_path / "untied")
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # what reaches transformers' own handlers (which hold their own stderr)
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        for path in (model_dir, tmp_path / "untied"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nothing to warn about
                load_critic(str(path))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []

    state = {k: v for k, v in untied.state_dict().items() if k != "model.norm.weight"}
    broken = tmp_path / "broken"
    untied.save_pretrained(broken, state_dict=state)
    with pytest.warns(UserWarning, match=r"weights newly initialised \['model.norm.weight'\]"):
        load_critic(str(broken))


def test_response_values_are_the_critic_at_each_response_state_without_dropout_or_padding_effects(model_dir):
    """values[:, t] = V(prompt + response[:t]), the same with or without left padding and in train mode."""
    tokenizer = load_tokenizer(model_dir)
    critic = load_critic(model_dir)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight)  # a trained-looking head, so values are not all zero
    short, long = "Tom has 3 apples.", "Anna has 12 books. She sells 4. How many books does Anna have now?"
    response = " She has 8. #### 8"
    batch = _rollout_batch(tokenizer, [short, long], [response, response])
    critic.train()
    values = response_values(critic, batch)
    assert torch.equal(values, response_values(critic, batch))  # no dropout noise
    critic.eval()
    assert int((batch.prompt_mask[0] == 0).sum()) > 0  # the short prompt is padded
    prompt, answer = tokenizer.encode(short), tokenizer.encode(response)
    alone = critic(input_ids=torch.tensor([prompt + answer])).logits[0, :, 0]  # (P + R,) one unpadded sequence
    expected = alone[len(prompt) - 1:len(prompt) - 1 + len(answer)]  # the state before each response token
    torch.testing.assert_close(values[0], expected, rtol=1e-4, atol=1e-4)


def test_response_values_are_float32_for_a_bfloat16_critic(model_dir):
    tokenizer = load_tokenizer(model_dir)
    critic = load_critic(model_dir, "bfloat16")
    assert critic.score.weight.dtype == torch.bfloat16
    assert response_values(critic, _rollout_batch(tokenizer, ["Tom has 3 apples."], [" 3"])).dtype == torch.float32


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        resolve_dtype("fp8")


def test_gradient_checkpointing_recomputes_the_layers_in_eval_mode_and_changes_no_gradient(model_dir):
    """model.gradient_checkpointing=true: each decoder layer runs again in the backward (its MLP is called twice
    per forward + backward, against once without), no module that could drop out is in training mode, and
    the gradients are those of the plain model. (transformers checkpoints only layers in training mode, and
    ours are in eval mode: without rlhf.setup.enable_gradient_checkpointing nothing would be recomputed.)"""
    from rlhf.config import load_config
    from rlhf.setup import load_models

    tokenizer = load_tokenizer(model_dir)
    batch = _rollout_batch(tokenizer, ["1 + 2 = ?", "3 * 4 ="], ["3", "12 #### 12"])
    gradients, calls = {}, {}
    for checkpointing in (False, True):
        cfg = load_config(None, [f"model.path={model_dir}", f"model.gradient_checkpointing={checkpointing}",
                                 "trainer.log_kl_panel=false"])
        actor = load_models(cfg, model_dir)[0]
        mlp = actor.model.layers[0].mlp
        assert not actor.training and not mlp.training and not actor.model.layers[0].self_attn.training
        count, mlp_forward = [], mlp.forward

        def counted(*args, **kwargs):  # (a forward hook would not see the recomputation)
            count.append(1)
            return mlp_forward(*args, **kwargs)

        mlp.forward = counted
        out = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        out.logits.float().logsumexp(-1).mean().backward()
        calls[checkpointing] = len(count)
        gradients[checkpointing] = torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None])
    assert calls == {False: 1, True: 2}
    torch.testing.assert_close(gradients[True], gradients[False], rtol=1e-5, atol=1e-7)
