"""Reliability: exact resume, atomic checkpoints, signals, non-finite steps, wandb failures.

One uninterrupted 4-step run is the reference; every interrupted run below (killed with SIGKILL, stopped
with SIGTERM or Ctrl-C, killed while saving) is resumed and must reproduce its `metrics.jsonl` row for row:
same steps, same keys, same values (timing_s/* and perf/throughput aside). The runs use an adaptive KL
controller, two PPO epochs, a KL loss and an entropy bonus, so the weights, both optimizers, the KL
coefficient, the data order and the sampling RNG all move from step to step; a resume that lost any of
them would change the next step's numbers. Everything runs single-threaded, in-process and in
subprocesses alike, so the two agree to the bit.
"""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, assert_same_rows, tiny_overrides, tiny_qwen2

import rlhf.setup
import rlhf.step
import train
from rlhf import core_algos
from rlhf.checkpoint import latest_checkpoint, list_checkpoints, tied_weights_stored_once
from rlhf.config import load_config
from rlhf.tracking import read_metrics

NUM_STEPS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def overrides(artifacts, output_dir, *extra) -> list[str]:
    return tiny_overrides(artifacts, output_dir, "actor.ppo_epochs=2", "actor.entropy_coeff=0.01",
                          "actor.use_kl_loss=true", "actor.kl_loss_type=k3+", "algorithm.kl_ctrl.type=adaptive",
                          "algorithm.kl_ctrl.horizon=100", f"trainer.total_steps={NUM_STEPS}", "trainer.test_freq=2",
                          "trainer.save_freq=1", "trainer.max_ckpt_to_keep=3", "trainer.logger=none", *extra)


def run(artifacts, output_dir, *extra) -> list[dict]:
    train.main(load_config(None, overrides(artifacts, output_dir, *extra)))
    return read_metrics(os.path.join(output_dir, "metrics.jsonl"))


def spawn(artifacts, output_dir, *extra) -> subprocess.Popen:
    """`python train.py ...` in the background, single-threaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    # Its own wandb service, as a user's run has: wandb started in this process (an earlier test) exports
    # WANDB_SERVICE, and a child attached to that service would leave its run registered there when killed.
    env.pop("WANDB_SERVICE", None)
    return subprocess.Popen([sys.executable, "train.py", *overrides(artifacts, output_dir, *extra)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, proc, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def logged_steps(output_dir) -> list[int]:
    """The steps a running train.py has logged so far. Not read_metrics: the last line may be half-written."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


@pytest.fixture(scope="module")
def reference(artifacts, tmp_path_factory):
    """The uninterrupted run: (output_dir, metrics rows)."""
    out = str(tmp_path_factory.mktemp("reference"))
    return out, run(artifacts, out)


def test_reference_run_keeps_the_last_checkpoints(reference):
    out, rows = reference
    assert [r["step"] for r in rows] == list(range(NUM_STEPS + 1))
    assert [os.path.basename(c) for c in list_checkpoints(out)] == ["step_2", "step_3", "step_4"]
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".tmp")]
    # The KL coefficient and the KL itself move, so a resume that lost them would show.
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in rows[1:]]
    assert len(set(coefs)) == NUM_STEPS and rows[-1]["kl/full"] > 0


def test_resume_from_a_checkpoint_dir_matches_the_uninterrupted_run(artifacts, reference, tmp_path):
    ref_out, ref_rows = reference
    out = str(tmp_path / "run")
    shutil.copytree(ref_out, out)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "actor/pg_lo')  # the torn last line of a run killed mid-write
    rows = run(artifacts, out, f"trainer.resume_from={out}/checkpoints/step_2")
    assert_same_rows(rows, ref_rows)


def test_sigkill_then_resume_auto_matches_and_continues_the_wandb_run(artifacts, reference, tmp_path):
    out = str(tmp_path / "run")
    proc = spawn(artifacts, out, "trainer.logger=wandb")
    wait_for(lambda: latest_checkpoint(out) is not None, proc, "the first checkpoint")
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate()
    killed_at = latest_checkpoint(out)
    assert killed_at is not None and not killed_at.endswith(f"step_{NUM_STEPS}"), killed_at

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run(artifacts, out, "trainer.logger=wandb", "trainer.resume_from=auto")
    assert not [str(w.message) for w in caught if "wandb could not start" in str(w.message)]  # it did log to wandb
    assert_same_rows(rows, reference[1])
    runs = [name for name in os.listdir(os.path.join(out, "wandb")) if name.startswith("offline-run-")]
    assert len(runs) == 2 and len({name.rsplit("-", 1)[1] for name in runs}) == 1, runs  # one run id, two parts


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(artifacts, reference, tmp_path):
    out = str(tmp_path / "run")
    proc = spawn(artifacts, out, "trainer.save_freq=0", "trainer.total_steps=50")
    wait_for(lambda: 1 in logged_steps(out), proc, "step 1")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    last = logged_steps(out)[-1]
    assert last < NUM_STEPS, "the signal arrived too late to compare with the reference"
    assert [os.path.basename(c) for c in list_checkpoints(out)] == [f"step_{last}"]
    assert f"SIGTERM received: saved {out}/checkpoints/step_{last} after step {last}" in output
    assert f"trainer.output_dir={out} trainer.resume_from=auto" in output
    # total_steps=50 changes nothing before step 50, so the reference still applies.
    rows = run(artifacts, out, "trainer.save_freq=0", "trainer.resume_from=auto")
    assert_same_rows(rows, reference[1])


def test_ctrl_c_saves_a_checkpoint_and_stops(artifacts, tmp_path, monkeypatch, capsys):
    original, handler = train.train_step, signal.getsignal(signal.SIGINT)

    def interrupted_step(*args, **kwargs):
        out = original(*args, **kwargs)
        if args[4] == 2:  # the step number: train_step(cfg, plan, accelerator, run, step, ...)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(train, "train_step", interrupted_step)
    out = str(tmp_path / "run")
    rows = run(artifacts, out, "trainer.save_freq=0")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [os.path.basename(c) for c in list_checkpoints(out)] == ["step_2"]
    assert "SIGINT received: saved" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is handler  # restored


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it."""


def test_a_kill_while_saving_leaves_nothing_that_resume_would_pick(artifacts, reference, tmp_path, monkeypatch):
    original = train.save_checkpoint

    def dies_while_saving_step_3(accelerator, output_dir, step, keep, info=None):
        if step == 3:  # write the checkpoint's files, then die before the rename
            accelerator.save_state(os.path.join(output_dir, "checkpoints", "step_3.tmp"))
            os.remove(os.path.join(output_dir, "checkpoints", "step_3.tmp", "optimizer_1.bin"))
            raise Killed
        return original(accelerator, output_dir, step, keep, info)

    monkeypatch.setattr(train, "save_checkpoint", dies_while_saving_step_3)
    out = str(tmp_path / "run")
    with pytest.raises(Killed):
        run(artifacts, out)
    monkeypatch.undo()
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_3.tmp"))
    assert latest_checkpoint(out).endswith("step_2")
    assert_same_rows(run(artifacts, out, "trainer.resume_from=auto"), reference[1])


class NaNGradient(torch.autograd.Function):
    """The identity, whose gradient is NaN: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


NAN_LOSSES = {
    "nan_value_and_gradient": lambda loss: loss * float("nan"),
    "nan_value_only": lambda loss: loss + float("nan"),  # the constant adds nothing to the gradient
    "nan_gradient_only": NaNGradient.apply,
}


@pytest.mark.parametrize("make_nan", NAN_LOSSES)
def test_non_finite_steps_are_skipped_counted_and_stop_the_run(artifacts, tmp_path, monkeypatch, make_nan):
    """A NaN loss (or its gradient) at steps 2, 4 and 5: step 2 is skipped and the run goes on; 4 and 5 are two
    bad steps in a row (trainer.max_bad_steps=2), so the run stops after 5 naming the checkpoint of step 3,
    the last one written: no checkpoint is written during a run of bad steps. Either a non-finite loss value
    or a non-finite gradient norm skips the update."""
    seen = {}
    original_prepare, original_update, original_loss = (rlhf.setup.prepare_data_and_models, rlhf.step.ppo_update,
                                                         core_algos.policy_loss)

    def spy(cfg, accelerator):
        seen["models"] = original_prepare(cfg, accelerator)
        return seen["models"]

    def nan_loss(*args, **kwargs):
        loss, metrics = original_loss(*args, **kwargs)
        return NAN_LOSSES[make_nan](loss), metrics

    def update(*args, **kwargs):
        with monkeypatch.context() as patch:
            if args[-2] in (2, 4, 5):  # the step number
                patch.setattr(core_algos, "policy_loss", nan_loss)
            return original_update(*args, **kwargs)

    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", spy)
    monkeypatch.setattr(rlhf.step, "ppo_update", update)
    out = str(tmp_path / "run")
    with pytest.raises(train.BadStepsError) as err:
        run(artifacts, out, "trainer.total_steps=8", "trainer.max_bad_steps=2", "trainer.max_ckpt_to_keep=10")
    message = str(err.value)
    assert "steps 4..5" in message and "trainer.max_bad_steps=2" in message
    assert f"{out}/checkpoints/step_3" in message and "trainer.resume_from=auto" in message

    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    num_actor_updates = 2 * 2  # 2 epochs x (8 prompts / 4 per mini-batch)
    assert [r["actor/skipped_updates"] for r in rows[1:]] == [0, num_actor_updates, 0, num_actor_updates,
                                                             num_actor_updates]
    assert [os.path.basename(c) for c in list_checkpoints(out)] == ["step_1", "step_3"]
    # The actor never took a non-finite update: its weights are those saved after step 3.
    actor = seen["models"][3]
    assert all(torch.isfinite(p).all() for p in actor.parameters())
    saved = load_file(os.path.join(out, "checkpoints", "step_3", "model.safetensors"))
    live = actor.state_dict()
    assert saved and all(torch.equal(live[k], v) for k, v in saved.items())


def test_wandb_not_installed(artifacts, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = str(tmp_path / "run")
    rows = run(artifacts, out, "trainer.logger=wandb", "trainer.total_steps=2", "trainer.save_freq=0")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert capsys.readouterr().out.count("warning: wandb is not installed") == 1
    assert not os.path.exists(os.path.join(out, "wandb"))


@pytest.mark.parametrize("failure", ["init", "log"])
def test_wandb_failures_leave_training_and_metrics_complete(artifacts, tmp_path, monkeypatch, failure):
    """wandb.init fails, or logging fails mid-run, with "no space left on device": one warning, no crash."""
    import accelerate.tracking
    import wandb

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if failure == "init":
        monkeypatch.setattr(wandb, "init", no_space)
    else:
        monkeypatch.setattr(accelerate.tracking.WandBTracker, "log", no_space)
    out = str(tmp_path / "run")
    with pytest.warns(UserWarning) as caught:
        rows = run(artifacts, out, "trainer.logger=wandb", "trainer.total_steps=2", "trainer.save_freq=0")
    if wandb.run is not None:  # left open when logging failed; close it before other tests start theirs
        wandb.finish()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "critic/vf_loss" in rows[-1] and "val/accuracy" in rows[-1]
    ours = [str(w.message) for w in caught if w.filename.endswith(os.path.join("rlhf", "tracking.py"))]
    assert len(ours) == 1 and "No space left on device" in ours[0], ours


def test_the_tied_embedding_is_saved_once_without_a_warning_and_resumed_tied(artifacts, tmp_path, monkeypatch,
                                                                              capfd, caplog):
    """The embedded model ties lm_head.weight to the input embedding. A checkpoint stores it once, without
    accelerate's "Removed shared tensor" warning; after a resume lm_head.weight is the embedding itself (one
    tensor, not a copy) and every weight is the saved one."""
    actors, original = [], rlhf.setup.prepare_data_and_models

    def spy(cfg, accelerator):
        models = original(cfg, accelerator)
        actors.append(models[3])
        return models

    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", spy)
    out = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        run(artifacts, out, "trainer.total_steps=1")
    printed = capfd.readouterr()
    assert "Removed shared tensor" not in printed.out + printed.err + caplog.text
    step_1 = os.path.join(out, "checkpoints", "step_1")
    saved = load_file(os.path.join(step_1, "model.safetensors"))
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # stored once

    run(artifacts, out, "trainer.total_steps=1", f"trainer.resume_from={step_1}")
    resumed = actors[-1]
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight
    assert resumed.lm_head.weight.data_ptr() == resumed.model.embed_tokens.weight.data_ptr()
    state = resumed.state_dict()
    assert all(torch.equal(state[name], value) for name, value in saved.items())
    initial = load_file(os.path.join(artifacts.model_dir, "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(saved["model.embed_tokens.weight"], initial)  # trained: the resume really loaded it


def test_only_the_tied_embedding_warning_is_silenced(caplog):
    """accelerate's safetensors save on a state dict with tied weights, and with a tensor that merely shares a
    weight's storage (a view, which loading would not restore): the first is silent, the second still warns."""
    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    PartialState(cpu=True)  # accelerate's logger needs its state
    model = tiny_qwen2(64, tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING), tied_weights_stored_once([model]):
        cleaned = clean_state_dict_for_safetensors(model.state_dict())
        assert "lm_head.weight" not in cleaned and caplog.text == ""
        weight = model.model.embed_tokens.weight.detach()
        clean_state_dict_for_safetensors({"model.embed_tokens.weight": weight, "first_row": weight[0]})
    assert "Removed shared tensor {'first_row'}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # outside the block accelerate's warning is back
        clean_state_dict_for_safetensors(model.state_dict())
    assert "Removed shared tensor {'lm_head.weight'}" in caplog.text


def test_a_trainer_state_saved_under_the_earlier_name_of_the_prompt_order_loads():
    """Checkpoints written before the prompt order had its own name hold it under "sampler"."""
    from rlhf.checkpoint import TrainerState

    state = TrainerState()
    state.load_state_dict({"step": 3, "sampler": {"epoch": 1, "position": 8}, "kl_ctrl": {"value": 0.1},
                           "bad_steps": 0, "wandb_run_id": None})
    assert state.prompt_order == {"epoch": 1, "position": 8} and "sampler" not in vars(state)
    assert TrainerState(**state.state_dict()) == state
