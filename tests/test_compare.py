"""The KL comparison: grid -> train.py overrides, the W&B sweep file, the runner, the report."""

import importlib.metadata
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import yaml

from rlhf import compare
from rlhf.config import Config, ConfigError, from_dict, kl_tags, load_config, run_label, to_dict
from rlhf.config import EmbeddedConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SWEEP = os.path.join(ROOT, "configs", "sweeps", "kl_estimators.yaml")


def load_sweep() -> dict:
    with open(SWEEP) as f:
        return yaml.safe_load(f)


def arm_config(arm: compare.Arm, *extra: str) -> Config:
    base = load_config(TINY)
    shared = compare.shared_overrides(compare.DEFAULT_STEPS, base.algorithm.kl_ctrl.kl_coef, None, "g")
    return load_config(TINY, compare.run_overrides(arm, "outputs/kl_estimators", "outputs/cache", shared, list(extra)))


# ----------------------------------------------------------------------------- the grid


def test_default_grid_is_the_issue_list():
    arms = [compare.Arm.parse(text) for text in compare.DEFAULT_GRID]
    assert {a.estimator for a in arms if a.placement == "reward"} == {"k1", "k3", "full"}
    assert {a.estimator for a in arms if a.placement == "loss"} == {"k1", "k2", "k3", "k3+", "full"}
    assert [a.name for a in arms if a.placement == "none"] == ["no-kl"]
    assert [a.name for a in arms] == list(compare.DEFAULT_GRID)  # names round-trip


def test_each_run_puts_the_kl_in_one_place_with_one_coefficient_seed_and_length():
    configs = {text: arm_config(compare.Arm.parse(text)) for text in compare.DEFAULT_GRID}
    for text, cfg in configs.items():
        placement, _, estimator = text.partition(":")
        assert cfg.algorithm.use_kl_in_reward == (placement == "reward")
        assert cfg.actor.use_kl_loss == (placement == "loss")
        if placement == "reward":
            assert cfg.algorithm.kl_penalty == estimator
        if placement == "loss":
            assert cfg.actor.kl_loss_type == estimator
        assert cfg.algorithm.kl_ctrl.type == "fixed"
        assert cfg.algorithm.kl_ctrl.kl_coef == cfg.actor.kl_loss_coef
        assert cfg.trainer.experiment_name == text
    assert len({c.trainer.seed for c in configs.values()}) == 1
    assert len({c.trainer.total_steps for c in configs.values()}) == 1
    assert len({c.algorithm.kl_ctrl.kl_coef for c in configs.values()}) == 1
    assert len({c.trainer.output_dir for c in configs.values()}) == len(configs)  # no two runs share files
    assert len({c.trainer.cache_dir for c in configs.values()}) == 1  # one warm start for all


def test_unknown_runs_are_refused_with_the_valid_forms():
    with pytest.raises(ValueError, match="reward:<estimator>, loss:<estimator>, no-kl"):
        compare.Arm.parse("rewards:k1")
    with pytest.raises(ValueError, match="valid names: .*k3\\+"):
        compare.Arm.parse("loss:k4")
    assert compare.main(["--runs", "loss:k4"]) == 2


def test_overrides_after_runs_are_not_taken_for_runs(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    assert compare.main(["--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb",
                         "--runs", "no-kl", "trainer.total_steps=2"]) == 0
    assert compare.last_step(str(out / "no-kl")) == 2


def test_extra_overrides_come_last_and_win():
    cfg = arm_config(compare.Arm.parse("loss:k2"), "actor.kl_loss_coef=0.5", "trainer.total_steps=2")
    assert cfg.actor.kl_loss_coef == 0.5 and cfg.trainer.total_steps == 2


def test_help_lists_the_grid_steps_and_output_options():
    text = compare.build_parser().format_help()
    for word in (*compare.DEFAULT_GRID, "--steps", f"default: {compare.DEFAULT_STEPS}", "--output-dir",
                 "--report-only", "--kl-coef", "--runs", "--offline", "--no-wandb"):
        assert word in text, word


# ----------------------------------------------------------------------------- the W&B sweep file


def sweep_points(sweep: dict) -> list[dict]:
    """W&B's grid: the Cartesian product of the `values` parameters, each with every `value` constant."""
    params = sweep["parameters"]
    grid = {k: p["values"] for k, p in params.items() if "values" in p}
    constants = {k: p["value"] for k, p in params.items() if "value" in p}
    return [dict(zip(grid, combo), **constants) for combo in itertools.product(*grid.values())]


def wandb_sweep_schema() -> dict:
    """The JSON schema of W&B sweep configs, as shipped in W&B's `sweeps` package (what `wandb[sweeps]`
    validates with). Read from the installed files, not imported: `import sweeps` needs scipy."""
    try:
        files = importlib.metadata.files("sweeps") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("W&B's sweep schema is not installed: pip install --no-deps sweeps==0.3.0")
    (path,) = [f for f in files if str(f) == "sweeps/config/schema.json"]
    with open(path.locate()) as f:
        return json.load(f)


def test_sweep_file_validates_against_the_wandb_schema():
    validator = jsonschema.Draft7Validator(wandb_sweep_schema(), format_checker=jsonschema.FormatChecker())
    sweep = load_sweep()
    assert [e.message for e in validator.iter_errors(sweep)] == []
    broken = dict(sweep, method="grids", parameters={"trainer.seed": {"valuez": [1]}})
    assert len(list(validator.iter_errors(broken))) >= 2  # the validator is not a no-op
    assert sweep["method"] == "grid" and sweep["program"] == "train.py"
    assert "${args_no_hyphens}" in sweep["command"] and "${program}" in sweep["command"]


def test_every_sweep_parameter_is_a_real_config_key():
    for name, spec in load_sweep()["parameters"].items():
        for value in spec.get("values", [spec.get("value")]):
            load_config(TINY, [f"{name}={value}"])  # raises ConfigError on an unknown key or a bad value
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(TINY, ["trainer.experiment_nam=x"])


def test_sweep_constants_match_the_runner_and_the_embedded_default():
    sweep, base = load_sweep(), load_config(TINY)
    params = sweep["parameters"]
    assert params["trainer.total_steps"]["value"] == compare.DEFAULT_STEPS
    assert params["algorithm.kl_ctrl.kl_coef"]["value"] == base.algorithm.kl_ctrl.kl_coef, (
        "keep the sweep's coefficient equal to configs/tiny.yaml's algorithm.kl_ctrl.kl_coef (the runner's default)")
    assert params["actor.kl_loss_coef"]["value"] == params["algorithm.kl_ctrl.kl_coef"]["value"]


def agent_command(sweep: dict, point: dict, interpreter: str, program: str) -> list[str]:
    """The argv W&B's agent runs for one grid point: its own rendering of the parameters
    (`create_sweep_command_args`) put into the file's `command` the way wandb_agent.py does."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    macros = create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    macros.update(env=["/usr/bin/env"], interpreter=[interpreter], program=[program])
    argv = []
    for chunk in map(str, sweep["command"]):
        argv += macros[chunk[2:-1]] if chunk.startswith("${") and chunk.endswith("}") else [chunk]
    return argv


@pytest.mark.skipif(shutil.which("sh") is None or not os.path.exists("/usr/bin/env"), reason="needs a POSIX shell")
def test_wandb_agent_runs_the_runners_grid(tmp_path):
    """Each W&B grid point, launched as the agent would, gives train.py the same config as the local runner."""
    echo = tmp_path / "echo_argv.py"  # stands in for train.py: prints the argv it was given
    echo.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    sweep = load_sweep()
    points = sweep_points(sweep)
    assert len(points) == len(compare.DEFAULT_GRID)  # one run per grid entry, no repeats
    seen = []
    for point in points:
        argv = agent_command(sweep, point, sys.executable, str(echo))
        got = json.loads(subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
        assert got[:2] == ["--config", "configs/tiny.yaml"]
        assert all("=" in word and " " not in word for word in got[2:]), got
        from_sweep = load_config(os.path.join(ROOT, got[1]), got[2:])
        name = from_sweep.trainer.experiment_name
        from_runner = arm_config(compare.Arm.parse(name))
        a, b = to_dict(from_sweep), to_dict(from_runner)
        for d in (a, b):
            d["trainer"].pop("group"), d["trainer"].pop("cache_dir")
        assert a == b, name
        seen.append(name)
    assert sorted(seen) == sorted(compare.DEFAULT_GRID)


# ----------------------------------------------------------------------------- the runner (stub trainer)


STUB_TRAIN = textwrap.dedent("""
    # Stands in for train.py (no torch, so it starts fast): applies the dotted overrides to a few defaults,
    # writes config.yaml and metrics.jsonl as train.py does, and crashes in step 2 of loss:k3.
    import json, os, sys
    import yaml
    cfg = {"model": {"path": "stub"}, "trainer": {"seed": 1}, "algorithm": {"kl_ctrl": {}}, "actor": {}}
    for item in sys.argv[3:]:  # argv: --config <file> key=value ...
        key, _, value = item.partition("=")
        *parents, name = key.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = yaml.safe_load(value)
    out, total = cfg["trainer"]["output_dir"], cfg["trainer"]["total_steps"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "val/accuracy": 0.25}) + "\\n")
        for step in range(1, total + 1):
            if cfg["actor"]["use_kl_loss"] and cfg["actor"].get("kl_loss_type") == "k3" and step == 2:
                sys.exit("boom: a crash in step 2")
            full = 0.01 * step
            row = {"step": step, "kl/full": full, "kl/k1": full + 0.002, "kl/k2": full - 0.001, "kl/k3": full,
                   "kl/abs": 3 * full, "critic/score/mean": 0.1 * step}
            if step == total:
                row["val/accuracy"] = 0.5
            f.write(json.dumps(row) + "\\n")
""")


@pytest.fixture
def stub_trainer(tmp_path, monkeypatch):
    path = tmp_path / "stub_train.py"
    path.write_text(STUB_TRAIN)
    monkeypatch.setattr(compare, "TRAIN_PY", str(path))
    return path


def test_runner_goes_on_after_a_failed_run_and_reports_it(stub_trainer, tmp_path, capsys):
    out = tmp_path / "cmp"
    stale = out / "no-kl"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text(json.dumps({"step": 7, "kl/full": 9.0}) + "\n")  # an old run's rows
    code = compare.main(["--runs", "no-kl", "loss:k3", "reward:k1", "--steps", "3", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path / "cache"), "--no-wandb"])
    assert code == 1  # one run failed, but the grid went on and the report was written
    printed = capsys.readouterr()
    assert "loss:k3" in printed.err and "boom: a crash in step 2" in printed.out
    rows = [json.loads(line) for line in (out / "no-kl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the stale run was replaced, not appended to
    assert (out / "reward-k1" / "metrics.jsonl").exists()
    assert "boom" in (out / "loss-k3" / "train.log").read_text()
    table = (out / "kl_estimators.md").read_text()
    assert "| KL in loss: k3 | 1/3 ⚠ |" in table and "loss:k3 failed (exit 1)" in table
    assert (out / "kl_estimators.png").stat().st_size > 20_000


def test_skip_done_keeps_finished_runs(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    args = ["--runs", "no-kl", "--steps", "2", "--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb"]
    assert compare.main(args) == 0
    before = (out / "no-kl" / "train.log").stat().st_mtime_ns
    assert compare.main([*args, "--skip-done"]) == 0
    assert (out / "no-kl" / "train.log").stat().st_mtime_ns == before
    assert compare.main([*args, "--steps", "3", "--skip-done"]) == 0  # not finished at 3 steps: rerun
    assert compare.last_step(str(out / "no-kl")) == 3


# ----------------------------------------------------------------------------- the report


def test_report_numbers_from_metrics(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    assert compare.main(["--runs", "reward:k1", "loss:k3+", "--steps", "4", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path), "--no-wandb"]) == 0
    os.remove(out / "kl_estimators.md")
    assert compare.main(["--report-only", str(out)]) == 0  # redrawn from the files alone
    lines = (out / "kl_estimators.md").read_text().splitlines()
    row = [c.strip() for c in next(line for line in lines if line.startswith("| KL in reward: k1 |")).strip("|").split("|")]
    # steps 1..4: kl/full = 0.01 * step, k1 = full + 0.002, k2 = full - 0.001, k3 = full, abs = 3 * full
    assert row[1:5] == ["4", "0.0400", "0.250 → 0.500", "0.250"]
    bias = [float(x) for cell in row[5:9] for x in cell.split(" ± ")]  # mean ± sd of kl/<est> - kl/full
    assert bias == pytest.approx([0.002, 0.0, -0.001, 0.0, 0.0, 0.0, 0.05, 0.026], abs=1e-9)
    header = next(line for line in lines if line.startswith("| run |"))
    for column in ("final exact KL", "val/accuracy", "mean reward", "k1 bias", "k2 bias", "k3 bias", "abs bias"):
        assert column in header
    assert [line.split(" | ")[0] for line in lines if line.startswith("| KL in")] == [
        "| KL in reward: k1", "| KL in loss: k3+"]  # reward runs before loss runs


def test_report_only_on_an_empty_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no train.py runs"):
        compare.write_report(str(tmp_path))


def test_run_label_names_placement_and_estimator():
    cfg = load_config(TINY, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
                             "actor.use_kl_loss=true", "actor.kl_loss_type=k3+"])
    assert run_label(cfg) == "reward:k3 + loss:k3+" == run_label(from_dict(to_dict(cfg)))
    assert kl_tags(cfg) == ["reward:k3", "loss:k3+"]
    assert compare.legend_name(run_label(cfg)) == "KL in reward: k3 + KL in loss: k3+"
    cfg.algorithm.use_kl_in_reward = cfg.actor.use_kl_loss = False
    assert run_label(cfg) == "no-kl" and compare.legend_name("no-kl") == "no KL"
    # The grid's run names are the same labels.
    assert [compare.Arm.parse(name).name for name in compare.DEFAULT_GRID] == list(compare.DEFAULT_GRID)


# ----------------------------------------------------------------------------- end to end, real train.py


def test_runner_drives_train_py_end_to_end(tmp_path, monkeypatch):
    """Two real train.py runs on a tiny embedded model, then the report from their metrics.jsonl."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    tiny = EmbeddedConfig(num_train=32, num_val=8, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, sft_steps=2, sft_batch_size=8)
    embedded = [f"embedded.{k}={v}" for k, v in vars(tiny).items()]
    out = tmp_path / "cmp"
    code = compare.main(["--runs", "no-kl", "loss:k3+", "--steps", "1", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path / "cache"), "--no-wandb", *embedded,
                         "data.train_batch_size=4", "data.max_val_samples=4", "data.max_response_length=8",
                         "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4", "trainer.test_freq=0"])
    assert code == 0, (out / "loss-k3+" / "train.log").read_text()[-3000:]
    for run in ("no-kl", "loss-k3+"):
        rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and "kl/full" in rows[1]
    assert "actor/kl_loss" in rows[1]  # the loss run really had the KL loss on
    table = (out / "kl_estimators.md").read_text()
    assert "| no KL | 1 |" in table and "| KL in loss: k3+ | 1 |" in table
