"""Evaluate a model on a config's held-out problems with the trainer's own evaluation, against a baseline.

    python -m rlhf.evaluate --model outputs/tiny/model --baseline outputs/cache/embedded-2c65decfc87b/model \\
        --config configs/tiny.yaml --samples 8 --output outputs/tiny/evaluation.json
    python -m rlhf.evaluate --model Qwen/Qwen2.5-0.5B-Instruct --config configs/gsm8k_qwen2.5_0.5b.yaml

`--model` (and `--baseline`) is any causal LM that transformers loads: a save_pretrained directory with its
tokenizer (a training run's <output_dir>/model, a LoRA run's adapters <output_dir>/model/adapter, merged into
their base model on loading, the embedded default's warm start, a converted model from
lab.real_parts) or a hub name. The config gives everything else, as in training: the held-out data
(data.val_files: the embedded default, a local GSM8K file, the hub), the prompts and chat template, the reward
(reward.function and reward.correct_threshold), the response length and sampling settings; `--samples k` is
trainer.val_samples (pass@k and maj@k from k responses per problem). The evaluation is
rlhf.held_out.evaluate's, so the numbers are the ones a training run logs for the same model: greedy
`val/accuracy`, `val/pass@k`, `val/maj@k` and the task's own metrics (the embedded default's habit rate).

It prints one row per metric: the model, the baseline, and their difference with a 95% interval paired by
problem (the mean over problems of the per-problem difference, Student t over problems: both models answer
the same problems, so the problems' difficulty cancels). `--output` writes the same as JSON, with each model's
per-problem values. Bad input (a path with no model, a tokenizer that is not the model's, a config without
held-out problems) is refused before any model loads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass

from rlhf.config import Config, ConfigError, load_config
from rlhf.rewards import RewardError, RewardFn

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_CHOICES = ("a directory written by save_pretrained with its tokenizer (a training run's <output_dir>/model, the "
                 "embedded default's warm start <trainer.cache_dir>/embedded-<hash>/model, a model converted by "
                 "python -m lab.real_parts), or a hub name such as Qwen/Qwen2.5-0.5B-Instruct")


@dataclass
class EvalRun:
    """What rlhf.held_out.evaluate reads of a training run (rlhf.setup.Setup), for one model: no optimizer,
    critic, reference or sampler."""

    tokenizer: object
    val_set: object  # datasets.Dataset with input_ids and ground_truth
    reward: RewardFn
    val_metrics: dict  # the task's own metrics of held-out responses (rlhf.setup.task_metrics)
    models: tuple = ()  # (actor,) once loaded (load_actor): evaluate reads models[0]


# ----------------------------------------------------------------------------- checks, before any model loads


def _is_local(path_or_name: str) -> bool:
    """A local path, existing or not: a hub id is `name` or `org/name`, and `org` is not a local directory."""
    if os.path.exists(path_or_name) or path_or_name.startswith((".", "/", "~")) or path_or_name.count("/") > 1:
        return True
    return "/" in path_or_name and os.path.isdir(path_or_name.split("/")[0])


def check_model_files(path_or_name: str, flag: str = "--model") -> None:
    """A local `path_or_name` must be a directory with config.json, weights and tokenizer files; ConfigError
    naming what is missing and the valid choices. A hub name is checked by `load_model_config`."""
    if not _is_local(path_or_name):
        return
    path = os.path.expanduser(path_or_name)
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{flag} {path_or_name!r} {what}; give {MODEL_CHOICES}.")
    files = sorted(os.listdir(path))
    if "config.json" not in files:
        if os.path.isfile(os.path.join(path, "model", "config.json")):
            raise ConfigError(f"{flag} {path_or_name!r} has no config.json; it looks like a training run's output "
                              f"directory, whose model is {os.path.join(path_or_name, 'model')!r}.")
        found = ", ".join(files[:8]) + (", ..." if len(files) > 8 else "")
        raise ConfigError(f"{flag} {path_or_name!r} holds no model (no config.json; found: {found or 'nothing'}); "
                          f"give {MODEL_CHOICES}.")
    if not any(name in files for name in WEIGHT_FILES):
        raise ConfigError(f"{flag} {path_or_name!r} has config.json but no weights (one of {', '.join(WEIGHT_FILES)}); "
                          "write them with model.save_pretrained(dir).")
    if not any(name in files for name in TOKENIZER_FILES):
        raise ConfigError(f"{flag} {path_or_name!r} has no tokenizer (one of {', '.join(TOKENIZER_FILES)}); save the "
                          "model's tokenizer next to it with tokenizer.save_pretrained(dir).")


def load_model_config(path_or_name: str, flag: str = "--model"):
    """(config, generation config or None) of a model, from its config.json and generation_config.json alone
    (a hub name downloads those two files). ConfigError when there is none, or when the architecture is not a
    causal language model."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(path_or_name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path_or_name!r}: no model config could be read ({' '.join(str(e).split())[:300]}); "
                          f"give {MODEL_CHOICES}.") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"{flag} {path_or_name!r} is a {config.model_type!r} model, which AutoModelForCausalLM does "
                          "not load; give a causal language model (Qwen2, Llama, SmolLM2, ...).")
    try:
        generation_config = GenerationConfig.from_pretrained(path_or_name)
    except OSError:  # no generation_config.json: the model's config alone says how sequences end
        generation_config = None
    return config, generation_config


def _ids(value) -> set[int]:
    """A config's token id field (None, an int or a list of ints) as a set."""
    if value is None:
        return set()
    return {int(i) for i in (value if isinstance(value, (list, tuple)) else [value])}


def check_tokenizer(tokenizer, config, generation_config, where: str) -> None:
    """Refuse a tokenizer that is not the model's, from the files alone (ConfigError):
    - it has more token ids than the model's embedding has rows (config vocab_size): those ids would index past
      it. Fewer is normal: embeddings are padded (Qwen2.5: 151,665 tokens, 151,936 rows);
    - its EOS (BOS) token is not one the model's config.json or generation_config.json names for that role:
      the ids mean other tokens to the model, and responses would not stop where the model ends them.
    A side the configs leave unset (Qwen2.5's tokenizer has no BOS) is not compared."""
    text_config = config.get_text_config()
    vocab_size = text_config.vocab_size
    num_ids = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if num_ids > vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {num_ids} token ids but the model's embedding has "
                          f"{vocab_size} rows (config.json vocab_size): ids {vocab_size} and up would index past it, "
                          "so this is not the model's tokenizer; save the model's own tokenizer with it.")
    for role in ("eos", "bos"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        model_ids = _ids(getattr(text_config, f"{role}_token_id", None))
        if generation_config is not None:
            model_ids |= _ids(getattr(generation_config, f"{role}_token_id", None))
        if token_id is not None and model_ids and token_id not in model_ids:
            names = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in sorted(model_ids) if i < num_ids)
            token = getattr(tokenizer, f"{role}_token")
            raise ConfigError(f"{where}: the tokenizer's {role.upper()} token is {token!r} (id {token_id}), but the "
                              f"model's config names id(s) {names or sorted(model_ids)} for it: this is not the "
                              "model's tokenizer (its ids mean other tokens to the model); save the model's own "
                              "tokenizer with it.")


def held_out_source(cfg: Config, config_path: str | None) -> str:
    """data.val_files, refused (ConfigError) when the config's task has no held-out problems (the lab's
    synthetic tasks)."""
    from rlhf.tasks import get_task

    where = f"config {config_path!r}" if config_path else "the config"
    source = cfg.data.val_files
    if not source or not get_task(cfg.task.name).has_held_out:
        raise ConfigError(f"{where} has no held-out problems to evaluate on (task.name={cfg.task.name!r}, "
                          f"data.val_files={source!r}); give a config whose data.val_files is 'embedded' "
                          "(configs/tiny.yaml), a local GSM8K .jsonl/.json/.parquet file, or a hub dataset such as "
                          "openai/gsm8k (configs/gsm8k_qwen2.5_0.5b.yaml).")
    return source


def load_checked_tokenizer(model: str, flag: str = "--model"):
    """The tokenizer of `model` (rlhf.models.load_tokenizer), after checking the model's files and that the
    tokenizer is the model's (check_model_files, load_model_config, check_tokenizer). Reads only config and
    tokenizer files; ConfigError on bad input."""
    from rlhf.models import load_tokenizer

    base = adapter_base(model)
    if base is not None:  # LoRA adapters: the architecture is the base model's, the tokenizer saved beside them
        check_model_files(base, f"the base model of {flag} {model!r} (adapter_config.json's base_model_name_or_path)")
    check_model_files(model if base is None else base, flag)
    config, generation_config = load_model_config(model if base is None else base, flag)
    has_tokenizer = any(os.path.exists(os.path.join(model, name)) for name in TOKENIZER_FILES)
    try:
        tokenizer = load_tokenizer(model if base is None or has_tokenizer else base)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {model!r}: its tokenizer does not load ({' '.join(str(e).split())[:300]}); save "
                          "the model's tokenizer next to it with tokenizer.save_pretrained(dir).") from None
    check_tokenizer(tokenizer, config, generation_config, f"{flag} {model!r}")
    return tokenizer


def prepare_eval_run(cfg: Config, accelerator, tokenizer, val_source: str, flag: str = "--model") -> EvalRun:
    """Everything `evaluate` needs for one model but the model itself: the held-out problems of `val_source`
    ("embedded" resolved already) in the prompts of the model's `tokenizer`, the config's reward and the task's
    metrics. ConfigError when a prompt is longer than data.max_prompt_length (a paired comparison needs them all)."""
    from rlhf.data import load_held_out
    from rlhf.rewards import load_reward
    from rlhf.tasks import get_task

    val_set, dropped = load_held_out(cfg, tokenizer, val_source)
    if dropped:
        raise ConfigError(f"{flag}: {dropped} of {len(val_set) + dropped} held-out prompts are longer than "
                          f"data.max_prompt_length={cfg.data.max_prompt_length} in this model's tokens; raise "
                          "data.max_prompt_length so that every problem is evaluated.")
    task = get_task(cfg.task.name)
    return EvalRun(tokenizer, val_set, load_reward(cfg, task.prompt_fields), task.val_metrics(cfg, val_set))


def adapter_base(path: str) -> str | None:
    """The base model of a directory of LoRA adapters in PEFT's format (a LoRA run's <output_dir>/model/adapter:
    adapter_config.json's base_model_name_or_path), or None for anything else."""
    config = os.path.join(os.path.expanduser(path), "adapter_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path!r} holds LoRA adapters whose adapter_config.json names no base model "
                          "(base_model_name_or_path); give the merged model directory beside them instead.")
    return base


def load_actor(accelerator, run: EvalRun, model: str) -> None:
    """Load `model` in float32, the dtype of every trained weight (a LoRA run's model.dtype is its frozen base's),
    onto the accelerator's device, in eval mode, as `run.models[0]`; LoRA adapters are loaded onto their base
    model and merged into it in float32 (peft), as the export merges them."""
    from rlhf.models import load_causal_lm

    base = adapter_base(model)
    if base is None:
        loaded = load_causal_lm(model, "float32")
    else:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(load_causal_lm(base, "float32"), model).merge_and_unload()
    actor = accelerator.prepare_model(loaded.eval(), evaluation_mode=True)
    run.models = (accelerator.unwrap_model(actor, keep_fp32_wrapper=False),)


# ----------------------------------------------------------------------------- the evaluation and its report


def paired_difference(values: list[float], reference: list[float]) -> dict[str, float | None]:
    """The mean over problems of values[i] - reference[i], and its 95% Student t interval (rlhf.stats);
    low/high None with fewer than 2 problems."""
    from rlhf.stats import Estimate

    estimate = Estimate(tuple(v - r for v, r in zip(values, reference, strict=True)))
    mean, half = estimate.mean, estimate.half_width
    return {"mean": mean, "half_width": half,
            "low": None if half is None else mean - half, "high": None if half is None else mean + half}


def evaluate_models(cfg: Config, models: dict[str, str], config_path: str | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Evaluate each of `models` ({"model": path, "baseline": path}, the baseline optional) on the config's
    held-out problems; returns the report (what --output writes). Every check runs before the first model
    loads; the models load one at a time."""
    from accelerate import Accelerator

    from rlhf.embedded import embedded_cache_dir, embedded_options
    from rlhf.held_out import evaluate_per_problem

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError("python -m rlhf.evaluate runs in one process; start it with python, not with several "
                          "processes (accelerate launch --num_processes N).")
    source = held_out_source(cfg, config_path)
    tokenizers = {role: load_checked_tokenizer(path, f"--{role}") for role, path in models.items()}
    accelerator = Accelerator(mixed_precision=cfg.trainer.mixed_precision)
    if source == "embedded":  # built on the first use (it trains the warm start), then read from the cache
        from rlhf.embedded import prepare_embedded_default

        source = prepare_embedded_default(embedded_cache_dir(cfg), embedded_options(cfg), log=accelerator.print).val_file
    runs = {role: prepare_eval_run(cfg, accelerator, tokenizers[role], source, f"--{role} {models[role]!r}")
            for role in models}
    metrics, per_problem = {}, {}
    for role, run in runs.items():
        accelerator.print(f"{role}: {models[role]}, {len(run.val_set)} held-out problems")
        load_actor(accelerator, run, models[role])
        metrics[role], per_problem[role] = evaluate_per_problem(cfg, accelerator, run, step=0)
        run.models = ()  # the next model loads into the memory this one held
    report = {
        "date": datetime.date.today().isoformat(),
        "config": config_path,
        "overrides": list(overrides),
        "held_out": {"data.val_files": cfg.data.val_files, "source": source, "split": cfg.data.val_split},
        "num_problems": len(runs["model"].val_set),
        "samples": cfg.trainer.val_samples,
        "models": dict(models),
        "metrics": metrics,
    }
    if "baseline" in models:
        report["differences"] = {name: paired_difference(per_problem["model"][name], per_problem["baseline"][name])
                                 for name in metrics["model"]}
        report["interval"] = "95% Student t over problems of the per-problem difference model - baseline"
    report["per_problem"] = per_problem
    return report


def format_report(report: dict) -> str:
    """The printed table: one row per metric, the model, the baseline and their paired difference."""
    def signed(x):
        return "n/a" if x is None else f"{x:+.3f}"

    held_out = report["held_out"]
    source = held_out["data.val_files"] if held_out["data.val_files"] == held_out["source"] else \
        f"{held_out['data.val_files']} ({held_out['source']})"
    sampled = f", and {report['samples']} samples per problem" if report["samples"] else ""
    lines = [f"{report['num_problems']} held-out problems of {source}, config {report['config'] or '(defaults)'}; "
             f"greedy{sampled}"]
    for role, path in report["models"].items():
        lines.append(f"{role}: {path}")
    names = list(report["metrics"]["model"])
    if "differences" in report:
        lines += ["", "| metric | model | baseline | model - baseline [95% interval, paired by problem] |",
                  "|---|---|---|---|"]
        for name in names:
            d, model, baseline = report["differences"][name], report["metrics"]["model"], report["metrics"]["baseline"]
            lines.append(f"| {name} | {model[name]:.3f} | {baseline[name]:.3f} "
                         f"| {signed(d['mean'])} [{signed(d['low'])}, {signed(d['high'])}] |")
    else:
        lines += ["", "| metric | model |", "|---|---|"]
        lines += [f"| {name} | {report['metrics']['model'][name]:.3f} |" for name in names]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """The command line (see the module docstring); returns the report."""
    parser = argparse.ArgumentParser(prog="python -m rlhf.evaluate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"the model to evaluate: {MODEL_CHOICES}")
    parser.add_argument("--baseline", default=None,
                        help="a model to compare it with, on the same problems (the same choices)")
    parser.add_argument("--config", default=None,
                        help="a YAML config (configs/tiny.yaml, ...): held-out data, prompts, reward, sampling; "
                             "its model.path is not used")
    parser.add_argument("--samples", type=int, default=None, metavar="K",
                        help="K sampled responses per problem, for pass@k and maj@K (trainer.val_samples; "
                             "0 = greedy only)")
    parser.add_argument("--output", default=None, metavar="JSON", help="write the report here as JSON")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. data.max_val_samples=64")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, *([f"trainer.val_samples={args.samples}"] if args.samples is not None else [])]
    cfg = load_config(args.config, overrides)
    import transformers

    transformers.logging.disable_progress_bar()  # "Loading weights" bars between the evaluation's own
    models = {"model": args.model, **({"baseline": args.baseline} if args.baseline else {})}
    report = evaluate_models(cfg, models, args.config, overrides)
    print(format_report(report))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.output}")
    return report


def cli(argv: list[str] | None = None) -> int:
    """main() as a command: exit status 2, and the message on stderr, for bad input."""
    try:
        main(argv)
    except (ConfigError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
