"""The typed config: defaults, YAML, dotted overrides, and early rejection of bad values."""

import os

import pytest

from rlhf.embedded import EmbeddedConfig
from rlhf.config import Config, ConfigError, config_table, load_config, warnings_for


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_follow_verl_names_and_values():
    cfg = load_config()
    assert cfg.algorithm.kl_penalty == "k1"
    assert cfg.actor.kl_loss_type == "low_var_kl"
    assert cfg.algorithm.kl_ctrl.type == "fixed"
    assert isinstance(cfg, Config)


def test_yaml_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "actor:\n  lr: 1.0e-4\n  kl_loss_type: k2\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(path, ["actor.kl_loss_type=k3+", "actor.use_kl_loss=true", "algorithm.kl_ctrl.type=adaptive"])
    assert cfg.actor.lr == 1e-4
    assert cfg.trainer.total_steps == 7
    assert cfg.actor.kl_loss_type == "k3+"
    assert cfg.actor.use_kl_loss is True
    assert cfg.algorithm.kl_ctrl.type == "adaptive"


def test_numbers_in_exponent_form_and_ints_for_floats():
    cfg = load_config(None, ["actor.lr=1e-6", "actor.clip_ratio=1"])
    assert cfg.actor.lr == pytest.approx(1e-6) and isinstance(cfg.actor.lr, float)
    assert cfg.actor.clip_ratio == 1.0 and isinstance(cfg.actor.clip_ratio, float)


@pytest.mark.parametrize("overrides, needles", [
    (["actor.kl_loss_typ=k3"], ["actor.kl_loss_typ", "Did you mean 'actor.kl_loss_type'"]),
    (["trainer.total_steps=ten"], ["trainer.total_steps", "expects int", "'ten'"]),
    (["actor.use_kl_loss=maybe"], ["actor.use_kl_loss", "expects bool"]),
    (["actor.kl_loss_type=k4"], ["actor.kl_loss_type", "k4", "low_var_kl"]),
    (["algorithm.kl_penalty=k3++"], ["algorithm.kl_penalty", "k3++"]),
    (["actor.kl_loss_type=full+"], ["actor.kl_loss_type", "full+"]),
    (["algorithm.kl_ctrl.kl_coef=-0.1"], ["kl_coef", "-0.1"]),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], ["horizon", "0"]),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=-1"], ["target_kl"]),
    (["algorithm.kl_ctrl.type=pid"], ["pid", "fixed", "adaptive"]),
    (["data.train_batch_size=30", "actor.ppo_mini_batch_size=16"], ["data.train_batch_size=30", "16"]),
    (["actor.ppo_micro_batch_size=5"], ["actor.ppo_micro_batch_size=5"]),
    (["data.max_response_length=0"], ["data.max_response_length", "> 0"]),
    (["actor.loss_agg_mode=sum"], ["actor.loss_agg_mode", "token-mean"]),
    (["model.path=./no/such/model"], ["model.path", "./no/such/model", "does not exist"]),
    (["data.train_files=/no/such/file.jsonl"], ["data.train_files", "/no/such/file.jsonl"]),
    (["trainer"], ["key=value"]),
    (["trainer.output_dir.x=1"], ["trainer.output_dir.x"]),
])
def test_bad_overrides_are_refused_with_the_key_and_choices(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*configs/tiny.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "actor: [unclosed\n"))
    with pytest.raises(ConfigError, match="unknown config key 'actr'. Did you mean 'actor'"):
        load_config(write(tmp_path, "actr:\n  lr: 1\n"))


def test_suspicious_settings_warn():
    cfg = load_config(None, ["actor.use_kl_loss=true", "actor.kl_loss_type=k1", "algorithm.kl_penalty=k3",
                             "rollout.top_k=50"])
    text = " ".join(warnings_for(cfg))
    assert "zero expected gradient" in text
    assert "biased gradient" in text
    assert "top_k" in text
    assert warnings_for(load_config()) == []
    assert any("k1" in w for w in warnings_for(load_config(None, ["actor.use_kl_loss=true", "actor.kl_loss_type=kl"])))
    assert not any("zero expected" in w for w in warnings_for(
        load_config(None, ["actor.use_kl_loss=true", "actor.kl_loss_type=k1+"])))


def test_shipped_configs_load():
    for name in ("configs/tiny.yaml", "configs/gsm8k_qwen2.5_0.5b.yaml"):
        load_config(name)


def test_yaml_boolean_words_in_text_fields(tmp_path):
    """YAML 1.1 reads `no` as False. An override takes the word as typed; a file gets a clear error."""
    assert load_config(None, ["trainer.mixed_precision=no"]).trainer.mixed_precision == "no"
    assert load_config(None, ["trainer.mixed_precision=bf16"]).trainer.mixed_precision == "bf16"
    assert load_config(None, ["trainer.log_kl_panel=no"]).trainer.log_kl_panel is False  # a real boolean
    with pytest.raises(ConfigError, match="mixed_precision.*choices|valid"):
        load_config(None, ["trainer.mixed_precision=off"])  # taken as the text "off", which is not a choice
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  mixed_precision: no\n")
    with pytest.raises(ConfigError, match="quote the word"):
        load_config(str(path))
    path.write_text("trainer:\n  mixed_precision: 'no'\n")
    assert load_config(str(path)).trainer.mixed_precision == "no"


def test_docs_config_table_is_the_schema():
    """docs/config.md's table of keys is config_table(): a key added, removed or re-documented shows up here."""
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")).read()
    assert config_table() in page
    assert config_table(EmbeddedConfig, "task.options.") in page  # the embedded default's task options
    assert "| `algorithm.adv_estimator` | `gae` |" in config_table()
