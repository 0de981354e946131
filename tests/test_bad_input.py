"""Bad input is refused early and clearly, through the command line `python train.py ...`.

Each row must exit with code 2 before any model loads, with one paragraph on stderr that names the key,
the bad value and the valid choices, and no traceback. The whole table runs through `train.cli` (what
`python train.py` calls) in this process; one row per path an error takes also runs as a real subprocess,
which must cost no more CPU than importing train.py does (give or take the variation of one start). The
limit is on the child's CPU time (its cost on an idle machine), never on wall time: on a shared test machine
the wall time can be several times longer.

`full` where logits are unavailable: in a config `full` is always available (the trainer has both models'
logits); from Python, `kl.kl_penalty(..., "full")` refuses and points to `full_kl`
(tests/test_kl.py::test_full_in_kl_penalty_points_to_full_kl).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rlhf.setup
import train
from rlhf.config import ConfigError, check_batch_sizes, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD_ANSWER = "2 + 3 = <<2+3=5>>5\n#### 5"

# (id, argv after `python train.py`, substrings the message must contain). `{tmp}` is a scratch directory
# holding bad.yaml, bad_rows.jsonl and no_answer_column.jsonl (written by `bad_files` below).
TABLE = [
    ("unknown key", ["actor.kl_loss_typ=k3"],
     ["'actor.kl_loss_typ'", "Did you mean 'actor.kl_loss_type'?", "kl_loss_coef"]),
    ("unknown section", ["actr.lr=1e-5"], ["'actr'", "Did you mean 'actor'?"]),
    ("wrong type", ["trainer.total_steps=ten"], ["'trainer.total_steps'", "expects int", "'ten'"]),
    ("not YAML value", ["trainer.total_steps=[3"], ["'trainer.total_steps'", "expects int", "'[3'"]),
    ("unknown KL in reward", ["algorithm.kl_penalty=k4"],
     ["'algorithm.kl_penalty'", "'k4'", "valid names: k1", "low_var_kl", "full"]),
    ("malformed KL in loss", ["actor.kl_loss_type=k3++"],
     ["'actor.kl_loss_type'", "'k3++'", "k3+", "single trailing '+'"]),
    ("full+ in loss", ["actor.kl_loss_type=full+"], ["'actor.kl_loss_type'", "'full+'", "use 'full'"]),
    ("negative KL loss coef", ["actor.kl_loss_coef=-0.1"], ["'actor.kl_loss_coef'", "-0.1", ">= 0"]),
    ("negative KL reward coef", ["algorithm.kl_ctrl.kl_coef=-1"], ["'algorithm.kl_ctrl.kl_coef'", "-1", ">= 0"]),
    ("prefill sub-batch 0", ["data.val_prefill_batch_size=0"], ["'data.val_prefill_batch_size'", "> 0", "got 0"]),
    ("adaptive target 0", ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"],
     ["'algorithm.kl_ctrl'", "target_kl", "got 0", "> 0"]),
    ("adaptive horizon < 0", ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=-5"],
     ["'algorithm.kl_ctrl'", "horizon", "got -5", "> 0"]),
    ("mini does not divide batch", ["data.train_batch_size=30", "actor.ppo_mini_batch_size=16"],
     ["data.train_batch_size=30", "actor.ppo_mini_batch_size=16", "divisors of 30: 1, 2, 3, 5, 6, 10, 15, 30"]),
    ("micro does not divide mini", ["actor.ppo_micro_batch_size=5"],
     ["actor.ppo_micro_batch_size=5", "divisors of 16"]),
    ("micro does not divide mini x n", ["rollout.n=3", "actor.ppo_micro_batch_size=32"],
     ["actor.ppo_micro_batch_size=32", "rollout.n", "divisors of 48"]),
    ("unknown advantage estimator", ["algorithm.adv_estimator=ppo"],
     ["'algorithm.adv_estimator'", "'ppo'", "valid estimators: gae, grpo, rloo"]),
    ("zero responses per prompt", ["rollout.n=0"], ["'rollout.n'", "got 0", "> 0"]),
    ("zero response length", ["data.max_response_length=0"], ["'data.max_response_length'", "got 0", "> 0"]),
    ("negative prompt length", ["data.max_prompt_length=-8"], ["'data.max_prompt_length'", "got -8", "> 0"]),
    ("unknown lr schedule", ["actor.lr_scheduler_type=exp"],
     ["'actor.lr_scheduler_type'", "'exp'", "valid choices: constant, linear, cosine"]),
    ("warmup past the last step", ["trainer.total_steps=5", "critic.lr_warmup_steps=6"],
     ["critic.lr_warmup_steps=6", "trainer.total_steps=5"]),
    ("reward module missing", ["reward.function=no_such_rewards:score"],
     ["'reward.function'", "'no_such_rewards'", "does not import", "expected an importable module"]),
    ("missing config file", ["--config", "{tmp}/nope.yaml"], ["nope.yaml", "does not exist", "configs/tiny.yaml"]),
    ("invalid YAML", ["--config", "{tmp}/bad.yaml"], ["bad.yaml", "not valid YAML", "line 3"]),
    ("missing model path", ["model.path=./no/such/model"],
     ["'model.path'", "./no/such/model", "does not exist", "'embedded'"]),
    ("missing data file", ["data.train_files={tmp}/missing.jsonl"],
     ["'data.train_files'", "missing.jsonl", "does not exist"]),
    ("rows without #### N", ["data.val_files={tmp}/bad_rows.jsonl"],
     ["'data.val_files'", "bad_rows.jsonl", "2 of 4 rows", "indices: 1, 3"]),
    ("no answer column", ["data.train_files={tmp}/no_answer_column.jsonl"],
     ["'data.train_files'", "missing column(s) ['answer']"]),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "bad.yaml").write_text("actor:\n  lr: 1.0e-5\n   ppo_epochs: 2\n")
    rows = [{"question": "q0", "answer": GOOD_ANSWER}, {"question": "q1", "answer": "five"},
            {"question": "q2", "answer": GOOD_ANSWER}, {"question": "", "answer": GOOD_ANSWER}]
    (tmp / "bad_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "no_answer_column.jsonl").write_text(json.dumps({"question": "q", "solution": GOOD_ANSWER}) + "\n")
    return str(tmp)


def run_cli(argv: list[str], command: tuple[str, ...] = ("train.py",)) -> tuple[int, str, str, float, float]:
    """`python train.py *argv` from the repository root -> (exit code, stdout, stderr, wall s, child CPU s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *command, *argv], cwd=REPO, env=env, stdout=out, stderr=err)
        killer = threading.Timer(120, proc.kill)
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, whatever else runs
        killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), wall, usage.ru_utime + usage.ru_stime


def check_refusal(name: str, code: int, stdout: str, stderr: str, needles: list[str], tmp: str) -> None:
    assert code == 2, (name, code, stderr[-2000:])
    assert "Traceback" not in stderr, stderr
    messages = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(messages) == 1, stderr  # one paragraph: a single line
    for needle in needles:
        assert needle.replace("{tmp}", tmp) in messages[0], (needle, messages[0])
    # Before any model loads: main() prints the resolved config before it loads anything.
    assert "resolved config" not in stdout and "train prompts" not in stdout


@pytest.mark.parametrize("name, argv, needles", TABLE, ids=[row[0] for row in TABLE])
def test_bad_input_is_refused_early_and_clearly(bad_files, name, argv, needles, monkeypatch, capsys):
    """The whole table through `train.cli`, the function `python train.py` runs, in this process."""
    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", lambda *a: pytest.fail("a model was loaded"))
    code = train.cli([a.replace("{tmp}", bad_files) for a in argv])
    out, err = capsys.readouterr()
    check_refusal(name, code, out, err, needles, bad_files)


# Through a real process: the first check a refusal can meet (an override) and the last one before any model
# loads (a data file). Every other path (a value check, the YAML file, ...) ends in the same ConfigError that
# cli() turns into exit code 2, and the in-process table above covers each of them.
SUBPROCESS_ROWS = ["unknown key", "rows without #### N"]


def test_bad_input_through_the_real_command_line(bad_files):
    """`python train.py ...` as a subprocess: exit code 2, the message, no traceback, and about the CPU
    time of what importing train.py alone costs (a Python start with torch, transformers and datasets: 5-13 s of
    CPU, depending on the machine and its load), so nothing heavy runs before the refusal.

    Every row of the table fails the same way (cli() catches ConfigError); these two rows are the earliest and
    the latest check before a model loads.
    """
    rows = [row for row in TABLE if row[0] in SUBPROCESS_ROWS]
    argvs = [[a.replace("{tmp}", bad_files) for a in argv] for _, argv, _ in rows]
    with ThreadPoolExecutor(max_workers=len(argvs) + 1) as pool:  # all at once: each child's own CPU time counts
        imports = pool.submit(run_cli, [], ("-c", "import train"))
        results = list(pool.map(run_cli, argvs))
        imports = imports.result()
    assert imports[0] == 0, imports[2][-2000:]
    for (name, _, needles), (code, stdout, stderr, wall, cpu) in zip(rows, results):
        check_refusal(name, code, stdout, stderr, needles, bad_files)
        # A refusal costs what the import costs (on a 2-core machine: 8.6-10.7 s against 9.5-10.2 s for the
        # import alone), and one start's CPU time varies by ~10% with the machine's load: so a bound relative
        # to the import (+30% + 1 s), which scales with the machine's speed. No wall-clock limit: the wall time
        # is the machine's load (a hang is killed after 120 s by run_cli, and then the exit code fails).
        assert cpu < 1.3 * imports[4] + 1, (f"{name}: {cpu:.1f} s of CPU ({wall:.0f} s wall), importing train.py "
                                           f"alone {imports[4]:.1f} s")


def test_batch_not_divisible_by_processes_is_refused():
    cfg = load_config(None, ["data.train_batch_size=6", "actor.ppo_mini_batch_size=3",
                             "actor.ppo_micro_batch_size=1"])
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size=3 is not divisible by number of processes=2"):
        check_batch_sizes(cfg, num_processes=2)


def test_the_embedded_default_fits_several_processes_as_it_is():
    """docs/gpu.md's multi-process command runs configs/tiny.yaml unchanged: a micro-batch larger than a
    process's share of the mini-batch is that share (32 responses per micro-batch, 16 per process on 2)."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [])
    for num_processes in (1, 2, 4):
        check_batch_sizes(cfg, num_processes=num_processes)
    cfg.actor.ppo_micro_batch_size = 12  # a smaller micro-batch must still divide the share
    with pytest.raises(ConfigError, match=r"divisors of 16"):
        check_batch_sizes(cfg, num_processes=2)


def test_world_size_without_distributed_setup_is_refused(tmp_path, monkeypatch, capsys):
    """Processes that say they are 2 (WORLD_SIZE) but were not started by a launcher would each set up a
    1-process run writing the same files; refuse them. (Where no GPU is visible, train.py runs a real launch
    on the CPU: tests/test_multiprocess.py. Here a GPU is pretended, so that path is not taken.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    code = train.cli([f"trainer.output_dir={tmp_path}", "trainer.logger=none"])
    assert code == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2" in err and "accelerate launch" in err


def test_suspicious_settings_warn_once_before_models_load(tmp_path, monkeypatch, capsys):
    class Stop(Exception):
        pass

    def no_models(cfg, accelerator):
        raise Stop

    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", no_models)
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.logger=none", "actor.use_kl_loss=true",
                             "actor.kl_loss_type=k1", "algorithm.kl_penalty=k3", "rollout.top_p=0.9",
                             "algorithm.kl_ctrl.kl_coef=0", "algorithm.adv_estimator=grpo"])
    with pytest.raises(Stop):
        train.main(cfg)
    out = capsys.readouterr().out
    for needle in ("zero expected gradient; this does not regularise", "biased gradient", "rollout.top_p=0.9",
                   "kl_coef=0: the penalty does nothing", "rollout.n=1: every group is one response"):
        assert out.count(needle) == 1, (needle, out)
