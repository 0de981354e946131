"""The KL comparison: grid -> train.py overrides, the W&B sweep file, the runner, the report."""

import importlib.metadata
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import jsonschema
import pytest
import yaml

from lab import compare
from rlhf.labels import kl_tags, run_label
from rlhf.config import Config, ConfigError, from_dict, load_config, to_dict
from rlhf.embedded import EmbeddedConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SWEEP_DIR = os.path.join(ROOT, "configs", "sweeps")

DEFAULT_REGIME = compare.REGIMES[compare.GRIDS["ppo"].regime]


def arm_config(arm: compare.Arm, *extra: str) -> Config:
    """The config the default grid (ppo, its default regime) gives `arm`, as `python -m lab.compare` makes it."""
    r = DEFAULT_REGIME
    shared = compare.shared_overrides(r.steps, r.kl_coef, None, "g", r.overrides)
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
        assert cfg.algorithm.kl_ctrl.kl_coef == cfg.actor.kl_loss_coef == DEFAULT_REGIME.kl_coef
        assert cfg.rollout.paired_noise  # same seed, same sampling noise: the differences are paired
        assert cfg.trainer.experiment_name == text
    assert len({c.trainer.seed for c in configs.values()}) == 1
    assert len({c.trainer.total_steps for c in configs.values()}) == 1
    assert len({c.algorithm.kl_ctrl.kl_coef for c in configs.values()}) == 1
    assert len({c.trainer.output_dir for c in configs.values()}) == len(configs)  # no two runs share files
    assert len({c.trainer.cache_dir for c in configs.values()}) == 1  # one warm start for all


def test_unknown_runs_are_refused_with_the_valid_forms():
    with pytest.raises(ValueError, match="reward:<estimator>, loss:<estimator>, loss-corrected:<estimator>, no-kl"):
        compare.Arm.parse("rewards:k1")
    with pytest.raises(ValueError, match="valid names: .*k3\\+"):
        compare.Arm.parse("loss:k4")
    assert compare.main(["--runs", "loss:k4"]) == 2


def test_overrides_after_runs_are_not_taken_for_runs(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    assert compare.main(["--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb",
                         "--runs", "no-kl", "trainer.total_steps=2"]) == 0
    assert compare.last_step(str(out / "no-kl")) == 2


def test_grpo_grid_runs_the_loss_estimators_on_the_grpo_config(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    compare.main(["--grid", "grpo", "--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb",
                  "--steps", "2"])  # the stub trainer fails loss:k3 on purpose
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name != "cache")
    assert dirs == sorted(compare.Arm.parse(run).dirname for run in compare.GRPO_GRID)
    for name in dirs:
        command = (out / name / "train.log").read_text().splitlines()[0]
        assert f"--config {compare.GRIDS['grpo'][1]}" in command
    grpo = load_config(compare.GRIDS["grpo"][1])
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.rollout.n > 1 and not grpo.algorithm.use_kl_in_reward


def test_extra_overrides_come_last_and_win():
    cfg = arm_config(compare.Arm.parse("loss:k2"), "actor.kl_loss_coef=0.5", "trainer.total_steps=2")
    assert cfg.actor.kl_loss_coef == 0.5 and cfg.trainer.total_steps == 2


def test_help_lists_the_grid_steps_and_output_options():
    text = compare.build_parser().format_help()
    for word in (*compare.DEFAULT_GRID, "--steps", "default: the regime's", "--output-dir", "--regime",
                 "separating (coefficient 0.1, 20 steps, actor.lr=2e-4)", "small (the config's coefficient, 20 steps)",
                 "--report-only", "--kl-coef", "--runs", "--offline", "--no-wandb", "--seeds", "seed<s>",
                 "95% interval", "paired", "rollout.paired_noise=true"):
        assert word in text, word


# ----------------------------------------------------------------------------- the W&B sweep files


# Each sweep file and what it must equal: lab.compare's grid, regime, seeds (`--seeds`) and output
# directory. Another regime's file goes here too; every sweep test runs on each.
SWEEPS = {"kl_estimators.yaml": dict(grid="ppo", regime="separating", seeds=3, output_dir="outputs/kl_estimators"),
          "kl_binding.yaml": dict(grid="ppo", regime="binding", seeds=3, output_dir="outputs/kl_binding")}


def load_sweep(name: str = "kl_estimators.yaml") -> dict:
    with open(os.path.join(SWEEP_DIR, name)) as f:
        return yaml.safe_load(f)


def sweep_points(sweep: dict) -> list[dict]:
    """W&B's grid: the Cartesian product of the `values` parameters, each with every `value` constant."""
    params = sweep["parameters"]
    grid = {k: p["values"] for k, p in params.items() if "values" in p}
    constants = {k: p["value"] for k, p in params.items() if "value" in p}
    return [dict(zip(grid, combo), **constants) for combo in itertools.product(*grid.values())]


def planned_runs(sweep: dict) -> list[dict]:
    """The runs W&B's own grid planner (`sweeps.grid_search_next_runs`, what a W&B server runs for
    `method: grid`) hands out for `sweep`, one after another until it says the grid is done: {key: value}."""
    try:
        with warnings.catch_warnings():  # its pydantic models are written for pydantic 1
            warnings.simplefilter("ignore")
            from sweeps.grid_search import grid_search_next_runs
            from sweeps.run import RunState
    except ImportError as e:
        pytest.fail(f"W&B's sweeps engine is not importable ({e}): pip install --no-deps sweeps==0.3.0, "
                    "and the test extra (jsonref, scipy)")
    runs = []
    while len(runs) < 1000:
        (run,) = grid_search_next_runs(runs, sweep, validate=True)
        if run is None:
            return [{k: v["value"] for k, v in r.config.items()} for r in runs]
        run.state = RunState.finished
        runs.append(run)
    pytest.fail("W&B's grid planner did not finish")


def wandb_sweep_schema() -> dict:
    """The JSON schema of W&B sweep configs, as shipped in W&B's `sweeps` package (what `wandb[sweeps]`
    validates with), read from the installed files."""
    try:
        files = importlib.metadata.files("sweeps") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("W&B's sweep schema is not installed: pip install --no-deps sweeps==0.3.0")
    (path,) = [f for f in files if str(f) == "sweeps/config/schema.json"]
    with open(path.locate()) as f:
        return json.load(f)


def runner_config(spec: dict, arm: compare.Arm, seed: int | None) -> Config:
    """The config `python -m lab.compare --grid <grid> --regime <regime> --seeds <n>` gives one run."""
    regime = compare.REGIMES[spec["regime"]]
    config = compare.GRIDS[spec["grid"]].config
    shared = compare.shared_overrides(regime.steps, regime.kl_coef, None, "g", regime.overrides)
    return load_config(config, compare.run_overrides(arm, spec["output_dir"], "cache", shared, [], seed))


def test_every_sweep_file_is_listed():
    """The comparison's sweeps (SWEEPS), and lab.decisions' own (tests/test_decisions.py)."""
    assert sorted(os.listdir(SWEEP_DIR)) == sorted([*SWEEPS, "decisions.yaml"])


@pytest.mark.parametrize("name", [*SWEEPS, "decisions.yaml"])
def test_sweep_file_validates_against_the_wandb_schema(name):
    validator = jsonschema.Draft7Validator(wandb_sweep_schema(), format_checker=jsonschema.FormatChecker())
    sweep = load_sweep(name)
    assert [e.message for e in validator.iter_errors(sweep)] == []
    broken = dict(sweep, method="grids", parameters={"trainer.seed": {"valuez": [1]}})
    assert len(list(validator.iter_errors(broken))) >= 2  # the validator is not a no-op
    if name == "decisions.yaml":  # lab.decisions' own flags, by `python -m lab.decisions ${args}`
        assert sweep["method"] == "grid" and sweep["command"][-3:] == ["-m", "lab.decisions", "${args}"]
        return
    assert sweep["method"] == "grid" and sweep["program"] == "train.py"
    assert "${args_no_hyphens}" in sweep["command"] and "${program}" in sweep["command"]


@pytest.mark.parametrize("name", SWEEPS)
def test_every_sweep_parameter_is_a_real_config_key(name):
    params = load_sweep(name)["parameters"]
    constants = [f"{key}={spec['value']}" for key, spec in params.items() if "value" in spec]  # sizes go together
    for key, spec in params.items():
        for value in spec.get("values", [spec.get("value")]):
            load_config(TINY, [*constants, f"{key}={value}"])  # raises ConfigError on an unknown key or a bad value
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(TINY, ["trainer.experiment_nam=x"])


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_constants_match_the_runners_regime_and_seeds(name):
    spec, params = SWEEPS[name], load_sweep(name)["parameters"]
    regime = compare.REGIMES[spec["regime"]]
    assert params["trainer.total_steps"]["value"] == regime.steps
    assert params["algorithm.kl_ctrl.kl_coef"]["value"] == regime.kl_coef, (
        "keep the sweep's coefficient equal to its regime's (lab/compare/grid.py, REGIMES)")
    assert params["actor.kl_loss_coef"]["value"] == params["algorithm.kl_ctrl.kl_coef"]["value"]
    assert params["rollout.paired_noise"]["value"] is True
    config = compare.GRIDS[spec["grid"]].config
    keys = [override.partition("=")[0] for override in regime.overrides]  # e.g. actor.lr (sizes go together)
    assert (load_config(config, [f"{key}={params[key]['value']}" for key in keys])
            == load_config(config, list(regime.overrides))), keys
    first = load_config(config).trainer.seed  # --seeds N starts from the config's seed
    assert params["trainer.seed"]["values"] == compare.seed_list(first, spec["seeds"])


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


POSIX = pytest.mark.skipif(shutil.which("sh") is None or not os.path.exists("/usr/bin/env"),
                           reason="needs a POSIX shell")


@POSIX
@pytest.mark.parametrize("name", SWEEPS)
def test_wandb_agent_runs_the_runners_grid_with_its_seeds(name, tmp_path):
    """W&B's planner hands out exactly lab.compare's runs x seeds, and each one, launched as the agent
    would, gives train.py the config the local runner gives it: same KL, regime, seed, run name
    (`<run>/seed<s>`) and directory (`<dir>/<run>/seed<s>/`)."""
    echo = tmp_path / "echo_argv.py"  # stands in for train.py: prints the argv it was given
    echo.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    spec, sweep = SWEEPS[name], load_sweep(name)
    points = planned_runs(sweep)
    as_text = lambda runs: sorted(json.dumps(run, sort_keys=True) for run in runs)
    assert as_text(points) == as_text(sweep_points(sweep))  # the planner's grid is the product, no more, no less
    regime = compare.REGIMES[spec["regime"]]
    arms = [compare.Arm.parse(text) for text in regime.runs or compare.GRIDS[spec["grid"]].runs]
    first = load_config(compare.GRIDS[spec["grid"]].config).trainer.seed
    expected = compare.grid_jobs(arms, compare.seed_list(first, spec["seeds"]))
    seen = []
    for point in points:
        argv = agent_command(sweep, point, sys.executable, str(echo))
        got = json.loads(subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
        assert got[:2] == ["--config", os.path.relpath(compare.GRIDS[spec["grid"]].config, ROOT)]
        assert all("=" in word and " " not in word for word in got[2:]), got
        from_sweep = load_config(os.path.join(ROOT, got[1]), got[2:])
        label, _, seed = from_sweep.trainer.experiment_name.partition("/seed")
        arm = compare.Arm.parse(label)
        a, b = to_dict(from_sweep), to_dict(runner_config(spec, arm, int(seed)))
        for d in (a, b):
            d["trainer"].pop("group"), d["trainer"].pop("cache_dir")
        assert a == b, from_sweep.trainer.experiment_name
        assert from_sweep.trainer.output_dir == compare.run_dir(spec["output_dir"], arm, int(seed))
        seen.append((arm, int(seed)))
    assert sorted(seen, key=repr) == sorted(expected, key=repr) and len(set(seen)) == len(seen)


@POSIX
def test_the_sweeps_runs_make_rlhf_compares_report(tmp_path):
    """The 27 runs of the sweep, launched as the agent would with the stub trainer in train.py's place,
    land where `python -m lab.compare --report-only outputs/kl_estimators` reads them: 9 runs x 3 seeds."""
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_TRAIN)
    sweep = load_sweep()
    for point in planned_runs(sweep):
        argv = agent_command(sweep, dict(point, **{"trainer.total_steps": 2}), sys.executable, str(stub))
        subprocess.run(argv, cwd=tmp_path, capture_output=True, check=False)  # the stub fails loss:k3 on purpose
    out = tmp_path / "outputs" / "kl_estimators"
    assert compare.main(["--report-only", str(out)]) == 0
    rows = table_rows((out / "kl_estimators.md").read_text())
    assert len(rows) == len(compare.DEFAULT_GRID)
    assert {row["seeds"] for row in rows.values()} == {"3"}
    assert rows["KL in loss: k2"]["steps"] == "2" and rows["KL in loss: k3"]["steps"] == "1/2 ⚠"


# ----------------------------------------------------------------------------- the runner (stub trainer)


STUB_TRAIN = textwrap.dedent("""
    # Stands in for train.py (no torch, so it starts fast): applies the dotted overrides to a few defaults,
    # writes config.yaml and metrics.jsonl as train.py does, and crashes in step 2 of loss:k3. It writes
    # when it ran and its OMP_NUM_THREADS to stub.json, after sleeping STUB_SLEEP seconds. A run whose
    # directory is named in STUB_PEERS first waits (at most 60 s) until every run named there has started,
    # and records whether they all did: runs that must go at once meet, however loaded the machine.
    import json, os, sys, time
    import yaml
    started = time.time()
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
    peers, met = [p for p in os.environ.get("STUB_PEERS", "").split(",") if p], None
    if os.path.basename(out) in peers:
        arrived = os.environ["STUB_PEER_DIR"]
        os.makedirs(arrived, exist_ok=True)
        open(os.path.join(arrived, os.path.basename(out)), "w").close()
        deadline = time.time() + 60
        while len(os.listdir(arrived)) < len(peers) and time.time() < deadline:
            time.sleep(0.05)
        met = len(os.listdir(arrived)) == len(peers)
    time.sleep(float(os.environ.get("STUB_SLEEP", "0")))
    with open(os.path.join(out, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    with open(os.path.join(out, "stub.json"), "w") as f:
        json.dump({"start": started, "end": time.time(), "met_peers": met,
                   "threads": os.environ.get("OMP_NUM_THREADS")}, f)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "val/accuracy": 0.25}) + "\\n")
        for step in range(1, total + 1):
            if cfg["actor"]["use_kl_loss"] and cfg["actor"].get("kl_loss_type") == "k3" and step == 2:
                sys.exit("boom: a crash in step 2")
            full = 0.01 * step
            row = {"step": step, "kl/full": full, "kl/full_forward": 2 * full, "kl/k1": full + 0.002, "kl/k2": full - 0.001, "kl/k3": full,
                   "kl/abs": 3 * full, "critic/score/mean": 0.1 * step}
            if step == total:
                row["val/accuracy"] = 0.5
            f.write(json.dumps(row) + "\\n")
""")


@pytest.fixture
def stub_trainer(tmp_path, monkeypatch):
    path = tmp_path / "stub_train.py"
    path.write_text(STUB_TRAIN)
    monkeypatch.setattr("lab.compare.grid.TRAIN_COMMAND", (sys.executable, str(path)))
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
    assert "| KL in loss: k3 | 1 | 1/3 ⚠ |" in table and "loss:k3 failed (exit 1)" in table
    assert (out / "kl_estimators.png").stat().st_size > 20_000  # a drawn figure: ~400 kB (matplotlib 3.11)


def test_skip_done_keeps_finished_runs(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    args = ["--runs", "no-kl", "--steps", "2", "--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb"]
    assert compare.main(args) == 0
    before = (out / "no-kl" / "train.log").stat().st_mtime_ns
    assert compare.main([*args, "--skip-done"]) == 0
    assert (out / "no-kl" / "train.log").stat().st_mtime_ns == before
    assert compare.main([*args, "--steps", "3", "--skip-done"]) == 0  # not finished at 3 steps: rerun
    assert compare.last_step(str(out / "no-kl")) == 3


def test_jobs_run_at_once_after_the_first_builds_the_warm_start(stub_trainer, tmp_path, monkeypatch):
    """--jobs 2: the first run alone while the embedded warm start is not cached, then two at a time, each
    with half the CPU threads; the status keeps the grid's order. "Two at a time" is checked by the two
    runs waiting for each other (the stub's STUB_PEERS), not by their clocks overlapping: on a loaded machine
    one Python start can take longer than the other run lasts."""
    monkeypatch.setenv("STUB_SLEEP", "1.5")  # so that a first run not left alone would overlap the others
    monkeypatch.setenv("STUB_PEERS", "reward-k1,loss-k2")
    monkeypatch.setenv("STUB_PEER_DIR", str(tmp_path / "arrived"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    out, runs = tmp_path / "cmp", ["no-kl", "reward:k1", "loss:k2"]
    assert compare.main(["--runs", *runs, "--steps", "1", "--jobs", "2", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path / "empty-cache"), "--no-wandb"]) == 0
    ran = {name: json.loads((out / name / "stub.json").read_text()) for name in ("no-kl", "reward-k1", "loss-k2")}
    assert {r["threads"] for r in ran.values()} == {"2"}
    # alone first: the runner waits for it to end before starting the next (one clock, one run after another)
    assert ran["no-kl"]["end"] <= min(ran["reward-k1"]["start"], ran["loss-k2"]["start"])
    assert ran["reward-k1"]["met_peers"] and ran["loss-k2"]["met_peers"]  # then both at once
    monkeypatch.setenv("STUB_SLEEP", "0")
    monkeypatch.delenv("STUB_PEERS")
    status = compare.run_grid([compare.Arm.parse(r) for r in runs], TINY, str(out), str(tmp_path), [
        "trainer.total_steps=1"], [], jobs=2)
    assert list(status) == runs and set(status.values()) == {"ok"}


def test_job_env_shares_the_threads_and_keeps_the_callers():
    caller = {"PATH": "/bin"}
    assert compare.job_env(caller, 1) is caller  # one job: untouched
    two = compare.job_env(caller, 2)
    assert two["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2)) and two["OMP_WAIT_POLICY"] == "PASSIVE"
    assert compare.job_env({"OMP_NUM_THREADS": "3"}, 2)["OMP_NUM_THREADS"] == "3"
    assert compare.main(["--jobs", "0", "--runs", "no-kl"]) == 2


# ----------------------------------------------------------------------------- the report


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The report's per-run table (the first table after `## Per run`, if there is such a heading):
    {run cell: {header: cell}}."""
    lines = [line for line in markdown.split("## Per run")[-1].splitlines() if line.startswith("|")]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    head = split(lines[0])
    return {cells[0]: dict(zip(head, cells)) for cells in map(split, lines[2:])}


def interval(cell: str) -> tuple[float, float | None]:
    """`0.0400 ± 0.0012` -> (0.04, 0.0012); `0.0400 (n=1)` -> (0.04, None)."""
    if cell.endswith("(n=1)"):
        return float(cell.split()[0]), None
    mean, half = cell.split(" ± ")
    return float(mean), float(half)


def test_report_numbers_from_metrics(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    assert compare.main(["--runs", "reward:k1", "loss:k3+", "--steps", "4", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path), "--no-wandb"]) == 0
    os.remove(out / "kl_estimators.md")
    assert compare.main(["--report-only", str(out)]) == 0  # redrawn from the files alone
    text = (out / "kl_estimators.md").read_text()
    rows = table_rows(text)
    row = rows["KL in reward: k1"]
    # steps 1..4: kl/full = 0.01 * step, k1 = full + 0.002, k2 = full - 0.001, k3 = full, abs = 3 * full;
    # one seed, so every number comes without an interval
    assert [row["seeds"], row["steps"]] == ["1", "4"]
    assert row["exact KL, last 5 steps (mean ± 95% CI)"] == "0.0250 (n=1)"  # the 4 steps' mean: fewer than 5
    assert row["forward KL, last 5 steps (mean ± 95% CI)"] == "0.0500 (n=1)"
    assert row["final val/accuracy (mean ± 95% CI)"] == "0.500 (n=1)"
    assert row["mean reward (mean ± 95% CI)"] == "0.250 (n=1)"
    bias = [interval(row[f"{e} bias (mean ± 95% CI)"]) for e in ("k1", "k2", "k3", "abs")]
    assert [m for m, _ in bias] == pytest.approx([0.002, -0.001, 0.0, 0.05], abs=1e-9)  # mean over steps
    assert [h for _, h in bias] == [None] * 4
    assert "before PPO (step 0): 0.250 in every run" in text
    assert "No `no-kl` run" in text and not any(h.startswith("Δ") for h in row)  # nothing to compare to
    assert list(rows) == ["KL in reward: k1", "KL in loss: k3+"]  # reward runs before loss runs


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


# ----------------------------------------------------------------------------- seeds: the runner


def test_seeds_fan_out_into_seed_directories_seed_by_seed(stub_trainer, tmp_path, capsys):
    out = tmp_path / "cmp"
    # one run at a time (--jobs 1), so that the runs' start lines come in the grid's order
    assert compare.main(["--runs", "no-kl", "reward:k1", "--steps", "2", "--seeds", "3", "--seed", "5", "--jobs", "1",
                         "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-wandb"]) == 0
    for run in ("no-kl", "reward-k1"):
        assert sorted(os.listdir(out / run)) == ["seed5", "seed6", "seed7"]
        for seed in (5, 6, 7):
            cfg = from_dict(yaml.safe_load((out / run / f"seed{seed}" / "config.yaml").read_text()))
            assert cfg.trainer.seed == seed
            assert cfg.trainer.output_dir == str(out / run / f"seed{seed}")
            assert cfg.trainer.cache_dir == str(tmp_path / "cache")  # one warm start for every seed
            assert cfg.trainer.experiment_name == f"{run_label(cfg)}/seed{seed}"
            assert cfg.trainer.total_steps == 2
    printed = capsys.readouterr().out
    order = [line.split(": ")[0] for line in printed.splitlines() if line.startswith("[")]
    assert order == ["[1/6] no-kl (seed 5)", "[2/6] reward:k1 (seed 5)", "[3/6] no-kl (seed 6)",
                     "[4/6] reward:k1 (seed 6)", "[5/6] no-kl (seed 7)", "[6/6] reward:k1 (seed 7)"]
    rows = table_rows((out / "kl_estimators.md").read_text())
    assert [rows[r]["seeds"] for r in ("no KL", "KL in reward: k1")] == ["3", "3"]
    assert "seeds 5, 6, 7" in (out / "kl_estimators.md").read_text()


def test_seed_overrides_come_after_the_extra_ones():
    """With several seeds, a trainer.seed among the key=value overrides sets the first seed, not all of them."""
    arm = compare.Arm.parse("loss:k2")
    shared = compare.shared_overrides(3, 0.01, None, "g")
    overrides = compare.run_overrides(arm, "out", "cache", shared, ["trainer.seed=1"], seed=43)
    assert overrides[-1] == "trainer.seed=43"
    cfg = load_config(TINY, overrides)
    assert cfg.trainer.seed == 43 and cfg.trainer.output_dir == os.path.join("out", "loss-k2", "seed43")
    one = load_config(TINY, compare.run_overrides(arm, "out", "cache", shared, []))  # one seed: today's layout
    assert one.trainer.output_dir == os.path.join("out", "loss-k2") and one.trainer.experiment_name == "loss:k2"
    assert compare.seed_list(99, 3) == [99, 100, 101]
    assert [seed for _, seed in compare.grid_jobs([arm], [7])] == [None]  # one seed: no seed folder
    with pytest.raises(ValueError, match="at least 1"):
        compare.seed_list(0, 0)


def test_seeds_start_from_an_overridden_seed(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    assert compare.main(["--runs", "no-kl", "--steps", "1", "--seeds", "2", "--output-dir", str(out),
                         "--cache-dir", str(tmp_path), "--no-wandb", "trainer.seed=99"]) == 0
    assert sorted(os.listdir(out / "no-kl")) == ["seed100", "seed99"]
    assert compare.main(["--runs", "no-kl", "--seeds", "0", "--output-dir", str(out)]) == 2


def test_skip_done_failures_and_layout_switch_with_seeds(stub_trainer, tmp_path):
    out = tmp_path / "cmp"
    common = ["--steps", "3", "--output-dir", str(out), "--cache-dir", str(tmp_path), "--no-wandb"]
    assert compare.main(["--runs", "no-kl", *common]) == 0  # one seed: <out>/no-kl/
    assert (out / "no-kl" / "metrics.jsonl").exists()
    args = ["--runs", "no-kl", "loss:k3", "--seeds", "2", "--seed", "1", *common]
    assert compare.main(args) == 1  # the stub crashes loss:k3 in step 2, with every seed
    # The one-seed run was removed (it would count as a third seed), the seed folders are there.
    assert sorted(os.listdir(out / "no-kl")) == ["seed1", "seed2"]
    text = (out / "kl_estimators.md").read_text()
    assert "loss:k3 (seed 1) failed (exit 1)" in text and "loss:k3 (seed 2) failed (exit 1)" in text
    assert table_rows(text)["KL in loss: k3"]["steps"] == "1/3 ⚠"
    before = (out / "no-kl" / "seed2" / "train.log").stat().st_mtime_ns
    assert compare.main([*args, "--skip-done"]) == 1
    assert (out / "no-kl" / "seed2" / "train.log").stat().st_mtime_ns == before  # finished: kept
    assert compare.main(["--runs", "no-kl", *common]) == 0  # back to one seed: the seed folders go
    assert "seed1" not in os.listdir(out / "no-kl")


# ----------------------------------------------------------------------------- seeds: the statistics


def t_coverage(q: float, df: int, intervals: int = 20_000) -> float:
    """P(|T| < q) for Student's t with df degrees of freedom: Simpson's rule on the density (no scipy)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = lambda x: math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))
    h = q / intervals
    total = density(0) + density(q) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, intervals))
    return 2 * total * h / 3


def test_t_table_is_the_95_percent_quantile_of_student_t():
    for df, q in compare.T95.items():
        log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        rounding = 2 * math.exp(log_norm - (df + 1) / 2 * math.log1p(q * q / df)) * 0.0005  # q has 3 decimals
        assert abs(t_coverage(q, df) - 0.95) < rounding + 1e-7, df
    assert compare.T95[1] == pytest.approx(math.tan(0.475 * math.pi), abs=5e-4)  # Cauchy: closed form
    assert [compare.t95(df) for df in (1, 2, 30, 35, 1000)] == [12.706, 4.303, 2.042, 2.042, 1.980]
    with pytest.raises(ValueError):
        compare.t95(0)


def test_estimate_mean_interval_and_resolution_by_hand():
    e = compare.Estimate((1.0, 2.0, 6.0))  # mean 3, sample sd sqrt((4 + 1 + 9) / 2) = sqrt(7)
    assert e.n == 3 and e.mean == 3.0 and e.sd == pytest.approx(math.sqrt(7))
    assert e.half_width == pytest.approx(4.303 * math.sqrt(7) / math.sqrt(3))  # t(2 df) = 4.303
    one = compare.Estimate((0.5,))
    assert (one.mean, one.sd, one.half_width) == (0.5, None, None)
    assert math.isnan(compare.Estimate(()).mean)


def test_paired_differences_by_hand():
    # Seeds 1-3 in both, seed 4 only in the reference: it is left out. The runs' own spread over seeds is
    # large (sd 1 and 0.976: per-run half-widths ~2.4), the per-seed differences' small: 0.2, 0.2, 0.25.
    run = {1: 1.0, 2: 2.0, 3: 3.0}
    reference = {1: 0.8, 2: 1.8, 3: 2.75, 4: 9.0}
    d = compare.paired_differences(run, reference)
    assert d.values == pytest.approx((0.2, 0.2, 0.25))
    assert d.mean == pytest.approx(0.65 / 3) and d.sd == pytest.approx(0.05 / math.sqrt(3))
    assert d.half_width == pytest.approx(4.303 * (0.05 / math.sqrt(3)) / math.sqrt(3))  # 0.0717
    assert compare.excludes_zero(d)  # 0.2167 > 0.0717: resolved, paired
    # The same numbers unpaired: the runs' intervals overlap by far (each ~2.4 wide on either side).
    a, b = compare.Estimate(tuple(run.values())), compare.Estimate(tuple(reference[s] for s in run))
    assert a.half_width + b.half_width > 4.5 > abs(a.mean - b.mean)
    assert compare.paired_differences({1: 1.0}, {2: 1.0}).n == 0  # no common seed, no difference


def test_paired_resolution_and_seeds_needed_by_hand():
    # Differences 0, 1, 2: mean 1, sd 1, half-width 4.303 / sqrt(3) = 2.484: 0 is inside. With n seeds the
    # half-width is t(n-1) / sqrt(n): n = 6 gives 2.571 / 2.449 = 1.050 (> 1), n = 7 gives 2.447 / 2.646 =
    # 0.925 (< 1), so 7.
    d = compare.Estimate((0.0, 1.0, 2.0))
    assert not compare.excludes_zero(d) and compare.seeds_needed(d) == 7
    assert not compare.excludes_zero(compare.Estimate((-0.5, 0.5)))  # mean 0 inside any interval
    assert compare.seeds_needed(compare.Estimate((-0.5, 0.5))) is None  # a mean of 0 never resolves
    assert compare.excludes_zero(compare.Estimate((-0.3, -0.3)))  # sd 0: every seed the same difference
    assert not compare.excludes_zero(compare.Estimate((0.0, 0.0)))  # identical runs: no difference
    one = compare.Estimate((0.5,))
    assert not compare.excludes_zero(one) and compare.seeds_needed(one) is None  # one seed: no spread
    # A tiny mean next to its spread: more than MAX_SEEDS_ESTIMATE seeds.
    assert compare.seeds_needed(compare.Estimate((-1.0, 1.0001))) == compare.MAX_SEEDS_ESTIMATE + 1


def write_run(directory, seed: int, rows: list[dict], total_steps: int = 2, **kl) -> None:
    """A run's config.yaml and metrics.jsonl (a step-0 evaluation, then `rows`), as train.py writes them; the
    KL is off unless set by `kl` (config keys in the form algorithm__use_kl_in_reward=True)."""
    config = {"model": {"path": "synthetic"}, "trainer": {"seed": seed, "total_steps": total_steps},
              "algorithm": {"kl_ctrl": {"kl_coef": 0.01}, "use_kl_in_reward": False},
              "actor": {"kl_loss_coef": 0.01, "use_kl_loss": False}}
    for key, value in kl.items():
        section, name = key.split("__")
        config[section][name] = value
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in [{"step": 0, "val/accuracy": 0.4}, *rows]))


def synthetic_rows(final_kl: float, accuracy: float, bias_k1: float) -> list[dict]:
    """Steps 1 and 2: kl/full 0.05 then `final_kl`; kl/k1 = kl/full + bias_k1 and the other estimators equal
    kl/full at both steps; critic/score/mean 0.1 then 0.3 (mean 0.2); val/accuracy `accuracy` at step 2."""
    rows = [{"step": s, "kl/full": full, "kl/k1": full + bias_k1, "kl/k2": full, "kl/k3": full, "kl/abs": full,
             "critic/score/mean": score} for s, full, score in ((1, 0.05, 0.1), (2, final_kl, 0.3))]
    rows[-1]["val/accuracy"] = accuracy
    return rows


@pytest.fixture
def synthetic(tmp_path):
    """no-kl and reward:k1 with seeds 1-3 in seed folders, loss:k3+ with one seed in the one-seed layout.

    Per seed   final kl/full     final val/accuracy  k1 bias (both steps)  mean reward
    no-kl      0.10 0.12 0.14    0.50 0.52 0.54      0.001 0.002 0.003     0.2 (every seed)
    reward:k1  0.02 0.03 0.04    0.47 0.52 0.48      0.004 0.004 0.004     0.2
    loss:k3+   0.06              0.60                0.0                   0.2
    (kl/full is 0.05 at step 1 in every run.)
    """
    out = tmp_path / "grid"
    reward = dict(algorithm__use_kl_in_reward=True, algorithm__kl_penalty="k1")
    for i, seed in enumerate((1, 2, 3)):
        write_run(out / "no-kl" / f"seed{seed}", seed,
                  synthetic_rows(0.10 + 0.02 * i, 0.50 + 0.02 * i, 0.001 * (i + 1)))
        write_run(out / "reward-k1" / f"seed{seed}", seed, synthetic_rows(0.02 + 0.01 * i, (0.47, 0.52, 0.48)[i], 0.004),
                  **reward)
    write_run(out / "loss-k3+", 1, synthetic_rows(0.06, 0.60, 0.0), actor__use_kl_loss=True, actor__kl_loss_type="k3+")
    return out


def test_aggregation_over_seeds_by_hand(synthetic):
    groups = compare.group_runs(compare.load_runs(str(synthetic)))
    assert [(g.label, g.seeds) for g in groups] == [("no-kl", [1, 2, 3]), ("reward:k1", [1, 2, 3]), ("loss:k3+", [1])]
    no_kl, k1, k3 = groups
    t2 = 4.303  # Student t, 2 degrees of freedom (3 seeds), two-sided 95%
    kl = no_kl.estimate(lambda r: r.final("kl/full"))
    assert kl.values == pytest.approx((0.10, 0.12, 0.14))  # the last step of each seed, not every step
    assert kl.mean == pytest.approx(0.12) and kl.half_width == pytest.approx(t2 * 0.02 / math.sqrt(3))
    assert k1.estimate(lambda r: r.final("kl/full")).half_width == pytest.approx(t2 * 0.01 / math.sqrt(3))
    bias = no_kl.estimate(lambda r: r.mean_bias("k1"))  # mean over steps, then over seeds
    assert bias.mean == pytest.approx(0.002) and bias.half_width == pytest.approx(t2 * 0.001 / math.sqrt(3))
    assert k3.estimate(lambda r: r.final("kl/full")).half_width is None  # one seed


def test_report_table_over_seeds_marks_resolved_differences(synthetic):
    assert compare.main(["--report-only", str(synthetic)]) == 0
    text = (synthetic / "kl_estimators.md").read_text()
    rows = table_rows(text)
    assert list(rows) == ["no KL", "KL in reward: k1", "KL in loss: k3+"]
    no_kl, k1, k3 = rows.values()
    assert [no_kl["seeds"], k1["seeds"], k3["seeds"]] == ["3", "3", "1"]
    hw = lambda sd, n=3, t=4.303: t * sd / math.sqrt(n)
    kl = "exact KL, last 5 steps"  # each seed's mean over its (two) steps: 0.05 and the final kl/full
    cases = [(no_kl, kl, 0.085, hw(0.01)), (k1, kl, 0.04, hw(0.005)),
             (no_kl, "final val/accuracy", 0.52, hw(0.02)), (k1, "final val/accuracy", 0.49, hw(math.sqrt(0.0007))),
             (no_kl, "k1 bias", 0.002, hw(0.001)), (k1, "k1 bias", 0.004, 0.0), (no_kl, "mean reward", 0.2, 0.0)]
    for row, column, mean, half in cases:
        got_mean, got_half = interval(row[f"{column} (mean ± 95% CI)"])
        places = 1e-4 if column == kl else 1e-3 if "bias" not in column else 0.051 * max(abs(mean), half)
        assert got_mean == pytest.approx(mean, abs=places), (column, row["run"])
        assert got_half == pytest.approx(half, abs=places), (column, row["run"])
    # Paired, seed by seed. KL: -0.040, -0.045, -0.050: mean -0.045, sd 0.005, half-width 4.303 * 0.005 /
    # sqrt(3) = 0.0124: resolved. Accuracy: -0.03, 0.00, -0.06: mean -0.03, sd 0.03, half-width 0.0745: not;
    # it needs t(n-1) * 0.03 / sqrt(n) < 0.03, n = 7 (2.447 / 2.646; n = 6 gives 2.571 / 2.449 > 1).
    # Reward: 0 for every seed. No forward KL logged: n/a.
    assert k1[f"Δ {kl} vs no KL (paired)"] == "-0.0450 ± 0.0124 resolved"
    assert k1["Δ final val/accuracy vs no KL (paired)"] == "-0.030 ± 0.075 not resolved (~7 seeds)"
    assert k1["Δ mean reward vs no KL (paired)"] == "+0.000 ± 0.000 not resolved (no difference)"
    assert k1["Δ forward KL, last 5 steps vs no KL (paired)"] == "n/a"
    assert no_kl[f"Δ {kl} vs no KL (paired)"] == "reference"
    assert k3[f"{kl} (mean ± 95% CI)"] == "0.0550 (n=1)"  # one seed: no interval, said so
    # loss:k3+ has seed 1 only: its one paired difference, (0.05 + 0.06) / 2 - 0.075, has no interval.
    assert k3[f"Δ {kl} vs no KL (paired)"] == "-0.0200 (n=1) not resolved (1 seed: no interval)"
    assert "**paired** difference" in text and "`(n=1)`: one seed, no interval" in text
    assert "seeds 1, 2, 3" in text
    assert (synthetic / "kl_estimators.png").stat().st_size > 20_000


def test_seeds_that_stopped_early_are_left_out_when_others_finished(synthetic):
    reward = dict(algorithm__use_kl_in_reward=True, algorithm__kl_penalty="k1")
    write_run(synthetic / "reward-k1" / "seed4", 4, synthetic_rows(9.0, 0.9, 0.004)[:1], **reward)  # step 1 of 2
    groups = {g.label: g for g in compare.group_runs(compare.load_runs(str(synthetic)))}
    assert groups["reward:k1"].seeds == [1, 2, 3] and [r.seed for r in groups["reward:k1"].stopped] == [4]
    compare.write_report(str(synthetic))
    text = (synthetic / "kl_estimators.md").read_text()
    assert table_rows(text)["KL in reward: k1"]["seeds"] == "3 (+1 stopped early, left out)"
    assert "reward:k1 (seed 4) (stopped early)" in text


def test_mean_curve_bands_over_seeds(synthetic):
    runs = [r for r in compare.load_runs(str(synthetic)) if r.label == "no-kl"]
    steps, mean, low, high = compare.mean_curve(runs, "kl/full")
    assert steps == [1, 2] and mean == pytest.approx([0.05, 0.12])
    assert high[1] - mean[1] == pytest.approx(4.303 * 0.02 / math.sqrt(3)) and low[0] == pytest.approx(0.05)
    _, _, low, high = compare.mean_curve(runs[:1], "kl/full")  # one seed: no band
    assert all(math.isnan(x) for x in low + high)


# ----------------------------------------------------------------------------- end to end, real train.py


def test_runner_drives_train_py_end_to_end(tmp_path, monkeypatch):
    """Two real train.py runs on a tiny embedded model, then the report from their metrics.jsonl."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    tiny = EmbeddedConfig(num_train=32, num_val=8, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, sft_steps=2, sft_batch_size=8)
    embedded = [f"task.options.{k}={v}" for k, v in vars(tiny).items()]
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
    assert "| no KL | 1 | 1 |" in table and "| KL in loss: k3+ | 1 | 1 |" in table  # seeds, steps


# ----------------------------------------------------------------------------- the claims


# Per seed (1, 2, 3), the level of kl/full over the last 5 steps; forward KL where the crossover needs it.
CLAIM_LEVELS = {
    "no-kl": (1.0, 1.5, 2.0),
    "loss:k2": (0.2, 0.6, 1.1), "loss:k3+": (0.2, 0.6, 1.1),  # the same run: identical rows
    "loss:full": (0.3, 0.7, 1.2), "loss:k3": (0.4, 0.9, 1.3),
    "loss:k1": (1.05, 1.45, 2.1), "reward:k1": (0.5, 1.4, 1.6), "reward:k3": (1.2, 1.8, 2.3),
}
CLAIM_FORWARD = {"loss:k3": (0.5, 1.0, 1.5), "loss:k3+": (0.6, 1.2, 1.6), "loss:k2": (0.6, 1.2, 1.6)}


def claim_rows(level: float, forward: float) -> list[dict]:
    """Steps 1-6: step 1 far off (9.0, outside the last 5 steps), steps 2-6 `level` (resp. `forward`) plus
    -0.02, -0.01, 0, 0.01, 0.02, so the mean of the last 5 steps is `level`."""
    rows = [{"step": 1, "kl/full": 9.0, "kl/full_forward": 9.0, "actor/kl_loss": 0.5, "timing_s/step": 1.0}]
    for step, offset in zip(range(2, 7), (-0.02, -0.01, 0.0, 0.01, 0.02)):
        rows.append({"step": step, "kl/full": level + offset, "kl/full_forward": forward + offset,
                     "critic/score/mean": 0.3, "actor/kl_loss": 0.1 * step, "timing_s/step": 1.0 + step})
    return rows


@pytest.fixture
def claim_grid(tmp_path):
    """The default grid's runs but reward:full, seeds 1-3, with the levels of CLAIM_LEVELS; k2 and k3+ in the
    loss log the same rows but for actor/kl_loss and the clocks."""
    out = tmp_path / "claims"
    for label, levels in CLAIM_LEVELS.items():
        placement, estimator = compare.parse_kl_tag(label)
        kl = {"none": {}, "reward": dict(algorithm__use_kl_in_reward=True, algorithm__kl_penalty=estimator),
              "loss": dict(actor__use_kl_loss=True, actor__kl_loss_type=estimator)}[placement]
        for i, seed in enumerate((1, 2, 3)):
            forward = CLAIM_FORWARD.get(label, levels)[i]
            rows = claim_rows(levels[i], forward)
            if label == "loss:k3+":  # k3's value in the KL loss, other clocks: both left out of (e)
                rows = [dict(r, **{"actor/kl_loss": 2 * r["actor/kl_loss"], "timing_s/step": 7.0}) for r in rows]
            write_run(out / compare.Arm.parse(label).dirname / f"seed{seed}", seed, rows, total_steps=6, **kl)
    return out


def test_claims_by_hand(claim_grid):
    groups = compare.group_runs(compare.load_runs(str(claim_grid)))
    results = compare.claims(groups)
    got = [(c.name, c.measure, c.effect, c.verdict) for c in results]
    # (e): per seed, step 0 (step, val/accuracy), step 1 (step and the two KLs; actor/kl_loss and the clock
    # left out), steps 2-6 (step, the two KLs, the score): 2 + 3 + 5 * 4 = 25 values, 75 in all.
    # Paired differences over seeds 1-3 (3 seeds: t = 4.303, half-width 4.303 * sd / sqrt(3)):
    #  k2 − no KL: -0.8, -0.9, -0.9: mean -0.867, sd 0.0577, half-width 0.143: resolved; full: -0.7, -0.8,
    #  -0.8 likewise; k3: -0.6, -0.6, -0.7: -0.633 ± 0.143.
    #  k1 in the loss − no KL: +0.05, -0.05, +0.1: +0.033 ± 0.190 (5% of k3's -0.633, the smallest of (a));
    #  k1 − k3 = 0.65, 0.55, 0.8, − full and − k2 larger still: each interval above 0: resolved.
    #  reward:k1 − no KL: -0.5, -0.1, -0.4: mean -0.333, sd 0.208, half-width 0.517: not resolved; with n
    #  seeds it needs t(n-1) / sqrt(n) < 0.333 / 0.208 = 1.601: n = 4 (3.182 / 2 = 1.591).
    #  reward:k3 − reward:k1: 0.7, 0.4, 0.7: +0.600 ± 0.430; − no KL: 0.2, 0.3, 0.3: +0.267 ± 0.143.
    #  crossover, forward: k3 − k3+ = -0.1, -0.2, -0.1: -0.133 ± 0.143, not resolved, n = 4 (t(3) / 2 =
    #  1.591 < 0.133 / 0.0577 = 2.309; n = 3 gives 2.484); reverse: k3+ − k3 = -0.2, -0.3, -0.2: measured
    #  lower (no direction is claimed for either: none is derived for this reward).
    assert got == [
        ("(a)", "kl/full: loss:k2 − no-kl", "-0.867 ± 0.143 (3 seeds)", "resolved"),
        ("(a)", "kl/full: loss:k3+ − no-kl", "-0.867 ± 0.143 (3 seeds)", "resolved"),
        ("(a)", "kl/full: loss:full − no-kl", "-0.767 ± 0.143 (3 seeds)", "resolved"),
        ("(a)", "kl/full: loss:k3 − no-kl", "-0.633 ± 0.143 (3 seeds)", "resolved"),
        ("(b)", "kl/full: loss:k1 − no-kl; and loss:k1 − each of (a)",
         "+0.033 ± 0.190 (3 seeds); 5% of (a)'s smallest (loss:k3: -0.633)", "resolved"),
        ("(c)", "kl/full: reward:k1 − no-kl", "-0.333 ± 0.517 (3 seeds)", "not resolved (~4 seeds)"),
        ("(d)", "kl/full: reward:k3 − reward:k1", "+0.600 ± 0.430 (3 seeds)", "measured: higher"),
        ("(d)", "kl/full: reward:k3 − no-kl", "+0.267 ± 0.143 (3 seeds)", "measured: higher"),
        ("(e)", "every logged number of loss:k2 and loss:k3+, step by step, seed by seed",
         "75 values equal (3 seeds × 7 logged steps)", "resolved"),
        ("crossover", "kl/full_forward: loss:k3 − loss:k3+", "-0.133 ± 0.143 (3 seeds)", "not resolved (~4 seeds)"),
        ("crossover", "kl/full: loss:k3+ − loss:k3", "-0.233 ± 0.143 (3 seeds)", "measured: lower"),
    ]
    (b,) = [c for c in results if c.name == "(b)"]
    assert b.difference.values == pytest.approx((0.05, -0.05, 0.1))


def test_claims_contradicted_missing_and_not_identical(claim_grid):
    # loss:full now ends above no KL in every seed: (a) for it is contradicted, and (b) too (k1 in the loss
    # ends below it).
    for i, seed in enumerate((1, 2, 3)):
        level = CLAIM_LEVELS["no-kl"][i] + 0.3
        write_run(claim_grid / "loss-full" / f"seed{seed}", seed, claim_rows(level, level), total_steps=6,
                  actor__use_kl_loss=True, actor__kl_loss_type="full")
    # One number of k3+ at one step differs from k2's: (e) is contradicted, naming it.
    path = claim_grid / "loss-k3+" / "seed2" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[3]["critic/score/mean"] = 0.31
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.rmtree(claim_grid / "reward-k3")
    results = {(c.name, c.measure): c for c in compare.claims(compare.group_runs(compare.load_runs(str(claim_grid))))}
    assert results[("(a)", "kl/full: loss:full − no-kl")].verdict == "contradicted"
    assert results[("(b)", "kl/full: loss:k1 − no-kl; and loss:k1 − each of (a)")].verdict == "contradicted"
    (e,) = [c for (name, _), c in results.items() if name == "(e)"]
    assert (e.verdict, e.effect) == ("contradicted", "seed 2, step 3: critic/score/mean 0.3 against 0.31")
    assert results[("(d)", "kl/full: reward:k3 − no-kl")].verdict == "not measured (no reward:k3 run)"


def test_claims_need_the_forward_kl_logged(synthetic):
    # The synthetic runs log no kl/full_forward; there is no loss:k3 either.
    results = compare.claims(compare.group_runs(compare.load_runs(str(synthetic))))
    crossover = [c.verdict for c in results if c.name == "crossover"]
    assert crossover == ["not measured (no loss:k3 run)"] * 2
    assert [c.verdict for c in results if c.name == "(c)"] == ["resolved"]  # reward:k1 vs no KL: paired


def test_report_opens_with_the_claims_table(claim_grid):
    png, md = compare.write_report(str(claim_grid))
    text = open(md).read()
    lines = text.splitlines()
    assert lines[2] == "## Claims" and lines[4].startswith("| claim |")
    assert text.index("## Claims") < text.index("## Per run") < text.index("![KL estimators]")
    assert "| (a) k2 in the loss holds the exact KL below no KL | kl/full: loss:k2 − no-kl | " \
           "-0.867 ± 0.143 (3 seeds) | **resolved** |" in text
    assert "| (c) k1 in the reward holds the exact KL below no KL | kl/full: reward:k1 − no-kl | " \
           "-0.333 ± 0.517 (3 seeds) | **not resolved (~4 seeds)** |" in text
    rows = table_rows(text)
    assert rows["KL in loss: k3"]["Δ exact KL, last 5 steps vs no KL (paired)"] == "-0.6333 ± 0.1434 resolved"
    assert rows["KL in loss: k3"]["Δ forward KL, last 5 steps vs no KL (paired)"] == "-0.5000 ± 0.0000 resolved"
    assert os.path.getsize(png) > 50_000


@pytest.mark.parametrize("above, verdict, share", [
    (0.3, "resolved: above no KL", "47%"),
    (0.7, "resolved: above no KL, by more than (a)'s smallest difference: not small", "111%"),
])
def test_claim_b_says_where_k1_in_the_loss_ends_when_that_resolves(claim_grid, above, verdict, share):
    # k1 in the loss `above` no KL in every seed: above each of (a), and above no KL (resolved too); by 0.7
    # it moves the KL more than (a)'s smallest difference (k3's, -0.633) does.
    for i, seed in enumerate((1, 2, 3)):
        level = CLAIM_LEVELS["no-kl"][i] + above
        write_run(claim_grid / "loss-k1" / f"seed{seed}", seed, claim_rows(level, level), total_steps=6,
                  actor__use_kl_loss=True, actor__kl_loss_type="k1")
    (b,) = [c for c in compare.claims(compare.group_runs(compare.load_runs(str(claim_grid)))) if c.name == "(b)"]
    assert b.verdict == verdict
    assert b.effect == f"+{above:.3f} ± 0.000 (3 seeds); {share} of (a)'s smallest (loss:k3: -0.633)"


# ----------------------------------------------------------------------------- the binding regime and the habit


def test_the_binding_regime_runs_rloo_at_a_coefficient_kept_by_the_clamp():
    """Its runs hold the issue's list; each run's config is RLOO (its advantages leave the coefficient as set)
    with one coefficient in both places; and at that coefficient the solver takes k3 in the loss onto the
    forward-KL optimum for a typical decision of the habit, as it does at 0.1; verl's clamp sends it to the corner
    only where the optimum itself lies past the clamp's edge (here below a coefficient of about 0.075)."""
    import torch

    from lab.habit import DECISION_REWARDS, habit_limits
    from lab.theory.fixed_points import bandit_fixed_point

    regime = compare.REGIMES["binding"]
    assert set(regime.runs) >= {"no-kl", "reward:k1", "loss:k3", "loss:k3+", "loss:k2", "loss:full"}
    shared = compare.shared_overrides(regime.steps, regime.kl_coef, None, "g", regime.overrides)
    for text in regime.runs:
        cfg = load_config(compare.DEFAULT_CONFIG, compare.run_overrides(compare.Arm.parse(text), "out", "c", shared, []))
        assert cfg.algorithm.adv_estimator == "rloo" and cfg.rollout.n > 1 and cfg.trainer.val_samples > 0
        assert cfg.actor.kl_loss_coef == cfg.algorithm.kl_ctrl.kl_coef == regime.kl_coef
    rewards = torch.tensor(DECISION_REWARDS, dtype=torch.float64)
    row = torch.tensor([0.82, 0.10, 0.08], dtype=torch.float64)  # a decision of the warm start's (q, p, other)
    for beta, lands in ((regime.kl_coef, True), (0.1, True), (0.07, False)):
        k3 = bandit_fixed_point(row, rewards, beta, "k3", "loss", advantage="rloo", n=4)[0].item()
        assert (abs(k3 - habit_limits(row[None], beta)["forward"].item()) < 1e-9) == lands, beta


def habit_rows(habit: float, forward: float) -> list[dict]:
    """Steps 1 and 2 with kl/full_forward `forward` and, at step 2, val/habit_rate `habit`."""
    rows = [{"step": s, "kl/full": 0.1, "kl/full_forward": forward, "critic/score/mean": 0.3} for s in (1, 2)]
    rows[-1].update({"val/accuracy": 0.5, "val/pass@1": 0.4, "val/habit_rate": habit})
    return rows


def test_habit_claims_pair_k3_with_k3_plus_by_seed(tmp_path):
    """k3 keeps 0.10 of the habit and k3+ 0.20 (+-0.01 by seed): the paired k3 - k3+ resolves below 0, so the
    claim is resolved when the prediction says less (-1), contradicted when it says more (+1); the forward KL
    is measured (lower), with no direction claimed; accuracy is measured, not claimed. The report shows both columns."""
    for seed, noise in zip((1, 2, 3), (-0.01, 0.0, 0.012)):
        write_run(tmp_path / "loss-k3" / f"seed{seed}", seed, habit_rows(0.10 + noise, 0.05),
                  actor__use_kl_loss=True, actor__kl_loss_type="k3")
        write_run(tmp_path / "loss-k3+" / f"seed{seed}", seed, habit_rows(0.20 + noise * 0.9, 0.15 + noise),
                  actor__use_kl_loss=True, actor__kl_loss_type="k3+")
    groups = compare.group_runs(compare.load_runs(str(tmp_path)))
    from lab.compare.habit import habit_claims

    for sign, expected in ((-1, "resolved"), (1, "contradicted")):
        by_measure = {c.measure: c for c in habit_claims(groups, sign)}
        habit = by_measure["val/habit_rate (end of run): loss:k3 − loss:k3+"]
        assert habit.verdict == expected and habit.difference.mean == pytest.approx(-0.1 + 0.0002 / 3)
        assert by_measure["kl/full_forward (end of run): loss:k3 − loss:k3+"].verdict == "measured: lower"
        assert by_measure["val/habit_rate (end of run): loss:k3 − loss:k2"].verdict.startswith("not measured")
        assert by_measure["val/accuracy (end of run): loss:k3 − loss:k3+"].verdict.startswith("not resolved")
    _, md = compare.write_report(str(tmp_path))
    text = open(md).read()
    assert "final sampled val/habit_rate" in text and "k3 in the loss keeps a different share" in text
    curves = json.load(open(tmp_path / "curves.json"))
    assert curves["loss:k3"]["curves"]["val/habit_rate"]["mean"] == [pytest.approx(0.10 + 0.002 / 3, abs=1e-5)]


def test_second_half_measures_how_far_a_run_still_moved(tmp_path):
    """An evaluation metric: last value minus the one at half the steps; a per-step metric: the mean of the
    last 5 steps minus that of the 5 steps up to half."""
    from lab.compare.habit import second_half

    rows = [{"step": s, "kl/full": 0.01 * s} for s in range(1, 21)]
    for step, habit in ((10, 0.3), (20, 0.25)):
        rows[step - 1]["val/habit_rate"] = habit
    write_run(tmp_path / "run", 1, rows, total_steps=20)
    (run,) = compare.load_runs(str(tmp_path))
    assert second_half("val/habit_rate")(run) == pytest.approx(0.25 - 0.3)
    assert second_half("kl/full")(run) == pytest.approx(0.01 * (18 - 8))  # steps 16-20 against 6-10
    assert second_half("kl/full_forward")(run) is None


def test_the_habit_claims_direction_is_the_solvers_not_written_in():
    """predicted_sign reads the direction off the solver's limits: k3 keeping more habit than k3+ at beta gives
    +1, less -1, no prediction None; and no KL claim of lab.compare carries a written-in direction (every
    crossover and forward-KL claim is measured)."""
    from lab.compare.claims import claims
    from lab.compare.habit import habit_claims, predicted_sign

    pred = {"betas": {0.3: {"k3": 0.13, "k3+": 0.26}, 0.2: {"k3": 0.09, "k3+": 0.05}}}
    assert predicted_sign(pred, 0.3) == -1 and predicted_sign(pred, 0.2) == 1
    assert predicted_sign(None, 0.3) is None and predicted_sign(pred, 0.1) is None
    crossover = [c for c in claims([]) if c.name == "crossover"]
    assert len(crossover) == 2 and all("no direction" in c.text for c in crossover)
    assert habit_claims([], -1) == []
