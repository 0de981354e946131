"""Two processes on CPU (gloo) against one process, on the same global batch: data parallel (DDP) and
sharded (FSDP2, through configs/accelerate/fsdp.yaml).

    accelerate launch --multi_gpu --num_processes 2 train.py ...
    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 --mixed_precision no train.py ...

(With no GPU, train.py runs the processes on the CPU over gloo itself, as ACCELERATE_USE_CPU=1 would; for
FSDP it also restores the FSDP setup that accelerate drops on the CPU: rlhf.setup.shard_on_cpu.)

What must hold: the global batch is split across the ranks; metrics are reduced over the ranks (not rank
0's share); evaluation covers the held-out set exactly once; only rank 0 writes files (each rank writes
its own RNG state into a checkpoint, which resume needs; with FSDP each also writes its shards). The two
runs must agree: losses and `kl/*` within a relative 1e-3 (measured: ~1e-4 at worst, from summing in a
different order), scores, lengths and accuracies exactly. Exactly on any machine, not just this one: the
scores and accuracies are the parity reward's (the answers alone), the lengths are greedy tokens, which float
noise cannot flip while no greedy choice is near a tie (the smallest gap between the two largest logits is
checked: 0.05, against logits that differ by ~1e-5); `critic/rewards/mean`, compared to 1e-6, carries the KL
penalty, whose float noise (coefficient x KL x 1e-4) is far below that. A sharded run resumed from its
checkpoint must repeat the uninterrupted run: bit for bit, since it is the same two processes' computation
with the same shapes, on the same machine.

To make the two runs see the same batch, sampling keeps only the most likely token (`rollout.top_k=1`:
two processes draw from two RNG streams, so with sampling their tokens would differ), and one mini-batch
per epoch holds the whole batch (so both runs take the same optimizer steps). The reward is the parity of
the reference answer (`reward.function`, a module the test writes next to the harness): known in advance,
so the accuracy of the whole held-out set is known, and non-zero, so the rewards and advantages are too.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from helpers import REPO, tiny_overrides

import train
from rlhf import rollout, step
from rlhf.config import load_config
from rlhf.rewards.gsm8k import extract_ground_truth
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
NUM_STEPS = 3
NUM_VAL = 7  # odd: the ranks evaluate 4 and 3 problems
EXACT = ["critic/score/mean", "critic/rewards/mean", "response_length/mean", "val/accuracy"]
CLOSE = ["actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/reward_kl_penalty", "actor/grad_norm",
         "actor/importance_ratio/max", "critic/advantages/max", "critic/advantages/min",
         "critic/grad_norm", "kl/k1", "kl/k2", "kl/k3", "kl/abs", "kl/full"]

HARNESS = '''
"""train.py's command line with a record of each rank's disk changes (its folder holds parity_reward.py)."""
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
import train
import rlhf.step

if os.environ.get("RESPONSES_DIR"):  # each rank's sampled response ids, one line per step
    real_sample = rlhf.step.generate
    def sample(*args, **kwargs):
        seq = real_sample(*args, **kwargs)
        with open(os.path.join(os.environ["RESPONSES_DIR"], "responses_rank%s.jsonl" % os.environ["RANK"]), "a") as f:
            f.write(json.dumps(seq.response_ids.tolist()) + "\\n")
        return seq
    rlhf.step.generate = sample
changes = []
def record(event, args):  # Python-level writes (torch.save's C++ writer is not seen)
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and (
            any(c in (args[1] or "") for c in "wax+") or args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
        changes.append(os.path.abspath(os.fspath(args[0])))
    elif event in ("os.rename", "os.remove", "shutil.rmtree") or (
            event == "os.mkdir" and not os.path.isdir(args[0])):  # makedirs(exist_ok=True) tries on every rank
        changes.append(os.path.abspath(os.fspath(args[0])))
record_file = os.path.join(os.environ["RECORD_DIR"], "changes_rank%s.json" % os.environ["RANK"])
sys.addaudithook(record)
code = train.cli(sys.argv[1:])
json.dump(changes, open(record_file, "w"))
sys.exit(code)
'''


PARITY_REWARD = """
def reward(completions, ground_truth, **fields):
    return [float(int(truth) % 2 == 0) for truth in ground_truth]
"""


@pytest.fixture(autouse=True)
def parity_reward(tmp_path, monkeypatch):
    """parity_reward.py in tmp_path, next to the harness `launch` writes, and importable here too."""
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))


def overrides(artifacts, output_dir, loss_agg_mode, *extra) -> list[str]:
    return tiny_overrides(artifacts, output_dir, "reward.function=parity_reward:reward",
                          f"data.max_val_samples={NUM_VAL}", "actor.ppo_mini_batch_size=8",
                          "actor.ppo_epochs=2", "actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
                          "actor.kl_loss_type=k3+", f"actor.loss_agg_mode={loss_agg_mode}", "rollout.top_k=1",
                          f"trainer.total_steps={NUM_STEPS}", "trainer.logger=none", *extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, args, accelerate_args=("--multi_gpu",)) -> subprocess.CompletedProcess:
    """`accelerate launch <accelerate_args> --num_processes 2 <harness> <args>` (with this interpreter), which
    must succeed; each rank's disk writes go to tmp_path/record."""
    record_dir, harness = tmp_path / "record", tmp_path / "harness.py"
    record_dir.mkdir(exist_ok=True)
    harness.write_text(HARNESS)
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}  # train.py's own choice
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "REPO": REPO, "RECORD_DIR": str(record_dir)})
    command = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(harness), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def rank_writes(tmp_path, output_dir) -> dict[int, list[str]]:
    """Paths under output_dir that each rank opened for writing, created, renamed or removed."""
    return {rank: [p for p in json.loads((tmp_path / "record" / f"changes_rank{rank}.json").read_text())
                   if p.startswith(str(output_dir))] for rank in (0, 1)}


def record_greedy_margins(monkeypatch) -> list[float]:
    """For every response token the run decodes (top_k=1 and greedy alike keep the largest logit), the gap
    between the two largest logits, recorded into the list returned."""
    gaps, steps = [], []
    real_next_token, real_generate = rollout.next_token, step.generate

    def next_token(logits, params, generator=None):
        top = logits.float().topk(2, dim=-1).values
        steps.append(top[:, 0] - top[:, 1])
        return real_next_token(logits, params, generator)

    def generate(*args, **kwargs):
        steps.clear()
        seq = real_generate(*args, **kwargs)
        mask = seq.response_mask.bool()  # (B, decoded steps): tokens after a response's end do not count
        gaps.extend(gap for t, decoded in enumerate(steps) for gap in decoded[mask[:, t]].tolist())
        return seq

    monkeypatch.setattr(rollout, "next_token", next_token)
    monkeypatch.setattr(step, "generate", generate)
    return gaps


def one_process_run(monkeypatch, output_dir, args) -> list[dict]:
    """The one-process run, in this process. Its greedy choices must be far from ties: the two runs' logits
    differ by float noise (other batch shapes, sums in another order, ~1e-5 after a few updates), and the
    exact comparison of their tokens (response lengths) holds on any machine only if no choice is that close."""
    gaps = record_greedy_margins(monkeypatch)
    train.main(load_config(None, args))
    print(f"smallest greedy margin: {min(gaps):.2e} over {len(gaps)} tokens")
    assert min(gaps) > 1e-3, f"a greedy choice is within {min(gaps):.1e} of a tie: its token is machine-dependent"
    return read_metrics(output_dir / "metrics.jsonl")


def assert_agree(one: list[dict], two: list[dict], artifacts) -> None:
    """Same steps; accuracy the known parity share; EXACT keys equal, CLOSE keys within 1e-3."""
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(NUM_STEPS + 1))
    with open(artifacts.val_file) as f:
        answers = [json.loads(line)["answer"] for line in f][:NUM_VAL]
    expected_accuracy = sum(int(extract_ground_truth(a)) % 2 == 0 for a in answers) / NUM_VAL
    assert 0 < expected_accuracy < 1
    for row in (one[0], one[-1], two[0], two[-1]):  # each problem counted once, by one rank
        assert row["val/accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)
    for a, b in zip(one[1:], two[1:]):
        for key in EXACT:
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
        assert set(a) == set(b)
        for key in CLOSE:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-7), (a["step"], key, a[key], b[key])
    assert two[-1]["kl/full"] > 0 and two[-1]["actor/kl_loss"] > 0


# token-mean normalises by the global mini-batch's tokens, seq-mean-token-mean by its sequences. grpo: two
# responses per prompt, grouped on the prompt's process, no critic. (With top_k=1 a group's responses are
# identical, so its advantages are 0: this case checks the critic-free path and the batch arithmetic with
# rollout.n under two processes, the KL loss and entropy gradients; the group statistics are checked by hand
# in tests/test_core_algos.py and tests/test_ppo.py.)
CASES = {"token-mean": ("token-mean",), "seq-mean-token-mean": ("seq-mean-token-mean",),
         "grpo": ("token-mean", "algorithm.adv_estimator=grpo", "rollout.n=2")}


# seq-mean-token-mean is slow (python -m pytest -q -m slow): token-mean and grpo keep the default run's time down;
# the aggregations themselves are pinned in one process by tests/test_core_algos.py and tests/test_ppo.py.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "seq-mean-token-mean"
                                  else case for case in CASES])
def test_two_processes_agree_with_one(artifacts, tmp_path, monkeypatch, case):
    out2 = tmp_path / "two"
    result = launch(tmp_path, overrides(artifacts, out2, *CASES[case]))
    assert "processes: 2 (MULTI_CPU)" in result.stdout
    out1 = tmp_path / "one"
    one = one_process_run(monkeypatch, out1, overrides(artifacts, out1, *CASES[case]))
    two = read_metrics(out2 / "metrics.jsonl")
    assert_agree(one, two, artifacts)
    if case == "grpo":
        assert "critic/vf_loss" not in two[-1] and two[-1]["critic/groups_with_equal_scores"] == 1.0
    else:
        assert two[-1]["actor/pg_loss"] != 0

    # Only rank 0 writes to the output directory. Rank 1 writes just its RNG state into the checkpoint (with
    # torch's C++ writer, which the record does not see). Both ranks read the data through `datasets`, which
    # may write to its own cache in ~/.cache.
    writes = rank_writes(tmp_path, out2)
    assert str(out2 / "metrics.jsonl") in writes[0] and str(out2 / "config.yaml") in writes[0]  # the record works
    assert writes[1] == [], writes[1]
    assert sorted(os.listdir(out2 / "checkpoints" / f"step_{NUM_STEPS}")) == sorted(
        os.listdir(out1 / "checkpoints" / f"step_{NUM_STEPS}") + ["random_states_1.pkl"])
    assert torch.get_num_threads() == 1  # the comparison ran single-threaded on both sides


@pytest.mark.slow  # ~25 s: two launches of two processes; python -m pytest -q -m slow
def test_fsdp_two_processes_agree_with_one_and_resume_exactly(artifacts, tmp_path, monkeypatch):
    """configs/accelerate/fsdp.yaml as a user launches it (2 processes, no mixed precision on the CPU): the
    actor and critic sharded, the reference whole, generation through the sharded actor."""
    fsdp = ("--config_file", os.path.join(REPO, "configs", "accelerate", "fsdp.yaml"))
    out2 = tmp_path / "fsdp"
    # save_freq=1 keeps step_2 and step_3. val_batch_size=3: the ranks' 4 and 3 held-out problems make 2 and
    # 1 batches, which would leave rank 0 alone in a collective forward without rlhf.processes.eval_batches.
    args = overrides(artifacts, out2, "token-mean", "trainer.save_freq=1", "data.val_batch_size=3")
    result = launch(tmp_path, args, fsdp)
    assert "processes: 2 (FSDP)" in result.stdout
    uninterrupted = read_metrics(out2 / "metrics.jsonl")
    out1 = tmp_path / "one"
    assert_agree(one_process_run(monkeypatch, out1, overrides(artifacts, out1, "token-mean")),
                 uninterrupted, artifacts)

    # The weights and optimizer states are sharded: one DCP file per rank for each model and optimizer.
    saved = out2 / "checkpoints" / f"step_{NUM_STEPS}"
    for part in ("pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "optimizer_0", "optimizer_1"):
        assert sorted(f for f in os.listdir(saved / part) if f.endswith(".distcp")) == [
            "__0_0.distcp", "__1_0.distcp"], part
    # Rank 1 writes its shards and RNG state into the checkpoint being written, nothing else.
    writes = rank_writes(tmp_path, out2)
    assert writes[1] and all(".tmp/" in path for path in writes[1]), writes[1]

    # A run killed after step 2's checkpoint, resumed with resume_from=auto, repeats step 3 exactly.
    shutil.rmtree(saved)
    result = launch(tmp_path, [*args, "trainer.resume_from=auto"], fsdp)
    assert f"resumed from {out2}/checkpoints/step_2 at step 2" in result.stdout
    resumed = read_metrics(out2 / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(NUM_STEPS + 1))
    # exact: step 3 computed again by the same two processes, same shapes, same thread count, same machine
    for key, value in uninterrupted[-1].items():
        if not key.startswith(("timing_s/", "perf/")):
            assert resumed[-1][key] == value, key


@pytest.mark.parametrize("launcher", ["ddp", "fsdp"])  # ~20 s each
def test_a_run_with_wandb_ends_cleanly_on_every_process(artifacts, tmp_path, monkeypatch, launcher):
    """With wandb logging on (offline), a 2-process run trains, exports its model, prints its summary and every
    process exits 0 (`launch` checks the exit status): the wandb run and the processes' group end on every
    process after the export's last collective (MetricsLogger.finish)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    accelerate_args = {"ddp": ("--multi_gpu",),
                       "fsdp": ("--config_file", os.path.join(REPO, "configs", "accelerate", "fsdp.yaml"))}[launcher]
    out = tmp_path / "run"
    result = launch(tmp_path, tiny_overrides(artifacts, out, "trainer.total_steps=1", "data.max_val_samples=4",
                                             "trainer.log_samples=2", "trainer.log_samples_freq=1"), accelerate_args)
    assert "done: step 1" in result.stdout
    assert f"samples:    {out / 'samples.jsonl'}" in result.stdout.splitlines()  # the summary names the file
    assert (out / "model" / "config.json").is_file()
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    assert len(list(run_dir.glob("run-*.wandb"))) == 1
    # The samples: wandb tables in the run's files, and samples.jsonl (the main process's first rows).
    tables = sorted(p.name.split("_")[0] for p in (run_dir / "files" / "media" / "table" / "samples").glob("*.table.json"))
    assert tables == ["train", "val", "val"]  # step 1's training batch; the evaluations at steps 0 and 1
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows] == [(0, "val")] * 2 + [(1, "train")] * 2 + [(1, "val")] * 2


def test_processes_sample_with_their_own_noise(artifacts, tmp_path, monkeypatch):
    """rollout.paired_noise off (the default): each process draws its own sampling noise (rlhf.setup seeds
    seed + process index). Every training prompt is the same one here, sampled at temperature 1, so processes
    sharing their noise would sample the same responses, row for row; with their own noise no row agrees."""
    with open(artifacts.train_file) as f:
        row = f.readline()
    same_prompt = tmp_path / "same_prompt.jsonl"
    same_prompt.write_text(row * 16)
    responses = tmp_path / "responses"
    responses.mkdir()
    monkeypatch.setenv("RESPONSES_DIR", str(responses))
    out = tmp_path / "run"
    launch(tmp_path, tiny_overrides(artifacts, out, f"data.train_files={same_prompt}", "rollout.temperature=1.0",
                                    "trainer.total_steps=1", "trainer.logger=none", "data.max_val_samples=2"))
    first, second = ([json.loads(line) for line in (responses / f"responses_rank{rank}.jsonl").read_text().splitlines()]
                     for rank in (0, 1))
    assert len(first) == len(second) == 1 and len(first[0]) == len(second[0]) == 4  # step 1: 4 responses each
    assert len({tuple(r) for r in first[0]}) == 4  # one process's rows differ: the samples are not degenerate
    assert not [i for i, (a, b) in enumerate(zip(first[0], second[0])) if a == b]


LAUNCH_CONFIGS = {"one_gpu": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP"}


def test_every_launch_config_is_one_these_tests_know():
    """No launch config in the repository that nothing runs (DeepSpeed's was removed: FSDP2 is the sharded path)."""
    assert sorted(os.listdir(os.path.join(REPO, "configs", "accelerate"))) == sorted(
        f"{name}.yaml" for name in LAUNCH_CONFIGS)


@pytest.mark.parametrize("name", LAUNCH_CONFIGS)
def test_accelerate_configs_parse_and_say_when_to_use_them(name):
    """accelerate's own loader accepts each config. (ddp and fsdp run above on CPU; one_gpu is the plain
    1-process run every other test makes, under bf16 autocast in bench/rehearse_gpu_recipe.py.)"""
    from accelerate.commands.config.config_args import ClusterConfig

    distributed_type = LAUNCH_CONFIGS[name]
    path = os.path.join(REPO, "configs", "accelerate", f"{name}.yaml")
    config = ClusterConfig.from_yaml_file(path)
    assert config.distributed_type == distributed_type and config.mixed_precision == "bf16"
    with open(path) as f:
        assert f.readline().startswith("# ")  # the comment saying when to use it comes first
