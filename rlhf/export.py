"""The trained model, as a Hugging Face directory a user loads with `from_pretrained` and no project code.

    export.save_model(accelerator, run, cfg, export.model_dir(output_dir))   # train.py, at the end of a run
    python -m rlhf.export outputs/tiny/checkpoints/step_40 outputs/tiny/model_step_40   # from any checkpoint

A model directory holds the weights (safetensors), config.json, generation_config.json, the tokenizer with its
chat template and, with `trainer.export_critic=true`, the critic in `critic/` (its backbone and trained value
head: `AutoModelForTokenClassification.from_pretrained(<dir>/critic)`; not `rlhf.models.load_critic`, which
zeroes the head for a fresh start). What the big frameworks get wrong here, and this module does not:

- EOS: generation_config.json lists every id the run stopped at (`rlhf.rollout.stop_token_ids`: Qwen2.5-
  Instruct's `<|im_end|>` and `<|endoftext|>`), so `model.generate` stops where the trainer's sampler did.
  TRL's PPOTrainer wrote its `stop_token_id` there, None unless set; verl's Megatron merge dropped
  generation_config.json and its second EOS id.
- Tied embeddings are stored once and stay one tensor after reload (verl saved them twice and, under
  transformers 5, did not re-tie them).
- Under DDP and FSDP2 the full state dict is gathered the way accelerate does it (`get_state_dict`: FSDP2's
  full state dict, offloaded to the CPU of rank 0) and written once, by the main process; a sharded FSDP2
  checkpoint is merged with torch's distributed-checkpoint reader, as accelerate's `merge_fsdp_weights` does.

One writer for both sources (a live run, a checkpoint's files): the weights go into a model rebuilt from the
config in the export dtype, whose ties are made again, and that model is saved by `save_pretrained`. A
directory is written to `<dir>.tmp` and renamed when complete.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from types import SimpleNamespace

import torch

from rlhf.checkpoint import RUN_INFO, tied_parameter_names
from rlhf.config import Config, ConfigError, load_config
from rlhf.lora import is_peft, merged_state
from rlhf.models import critic_config, load_tokenizer, resolve_dtype
from rlhf.rollout import stop_token_ids

MODEL_DIR = "model"  # <output_dir>/model, and <checkpoint>/model with trainer.save_model_with_checkpoints
CRITIC_DIR = "critic"  # <model dir>/critic with trainer.export_critic
ADAPTER_DIR = "adapter"  # <model dir>/adapter: a LoRA run's adapters in PEFT's format (PeftModel.from_pretrained)
# What accelerate's save_state writes for the i-th prepared model (0: the actor, 1: the critic): one file in a
# 1-process or DDP run, a distributed-checkpoint folder with one file per process under FSDP2.
_WEIGHTS = ("model.safetensors", "model_1.safetensors")
_FSDP_WEIGHTS = ("pytorch_model_fsdp_0", "pytorch_model_fsdp_1")
_RNG_STATE = "random_states_0.pkl"  # what save_state writes into every checkpoint (and a model directory lacks)


class ExportError(ValueError):
    """What cannot be exported, and why: the message names the path, the problem and what would work."""


def model_dir(output_dir: str) -> str:
    """Where a run's model goes: `<output_dir>/model`."""
    return os.path.join(output_dir, MODEL_DIR)


# ----------------------------------------------------------------------------- from a live run


def save_model(accelerator, run, cfg: Config, path: str) -> str:
    """Write the actor (and with `trainer.export_critic` the critic) of `run` to `path` as a Hugging Face
    directory; returns `path`. Every process calls it: under FSDP2 gathering the weights is collective."""
    actor, critic, _ = run.models
    policy = accelerator.unwrap_model(actor)
    stop_ids = stop_token_ids(policy, run.tokenizer)
    actor_state = plain_state(accelerator.get_state_dict(actor), cfg)  # FSDP2: full, on rank 0's CPU; others get {}
    critic_part = None
    if cfg.trainer.export_critic and critic is not None:
        critic_part = (accelerator.unwrap_model(critic).config, plain_state(accelerator.get_state_dict(critic), cfg))
    elif cfg.trainer.export_critic:
        accelerator.print(f"trainer.export_critic: this run has no critic (algorithm.adv_estimator="
                          f"{cfg.algorithm.adv_estimator}); exporting the policy only.")
    if accelerator.is_main_process:
        dtype = resolve_dtype(cfg.trainer.export_dtype) if cfg.trainer.export_dtype else None
        write_model(path, policy.config, actor_state, run.tokenizer, policy.generation_config, stop_ids, dtype,
                    critic_part)
        if is_peft(policy):  # the adapters alone, in PEFT's format, beside the merged model
            policy.save_pretrained(os.path.join(path, ADAPTER_DIR))
            run.tokenizer.save_pretrained(os.path.join(path, ADAPTER_DIR))
    accelerator.wait_for_everyone()
    return path


def plain_state(state: dict, cfg: Config) -> dict:
    """A model's state dict by transformers' names: a LoRA model's (PEFT's names) with its adapters merged into
    the weights (rlhf.lora.merged_state), anything else as it is."""
    lora = cfg.model.lora
    if not any(name.startswith("base_model.model.") for name in state):
        return state
    return merged_state(state, lora.alpha / lora.rank)


# ----------------------------------------------------------------------------- the one writer


def write_model(path: str, config, state: dict, tokenizer, generation_config, stop_ids: tuple[int, ...],
                dtype: torch.dtype | None = None, critic: tuple | None = None) -> None:
    """Write `state` (the policy's weights, by name) as a Hugging Face directory at `path`, replacing what is
    there once complete: weights in `dtype` (None: the dtype of `state`), `config`, a copy of
    `generation_config` whose EOS ids are `stop_ids`, the tokenizer; `critic` = (its config, its state) goes
    into `path/critic`."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    tmp = f"{path.rstrip(os.sep)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = dtype or trained_dtype(state)
    model = rebuild(AutoModelForCausalLM, config, state, dtype)
    model.generation_config = with_stop_ids(generation_config, stop_ids, tokenizer.pad_token_id)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if critic is not None:
        critic_config_, critic_state = critic
        value_model = rebuild(AutoModelForTokenClassification, critic_config_, critic_state, dtype)
        value_model.save_pretrained(os.path.join(tmp, CRITIC_DIR))
        tokenizer.save_pretrained(os.path.join(tmp, CRITIC_DIR))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def trained_dtype(state: dict) -> torch.dtype:
    """The dtype of the floating-point weights in `state` (the dtype they were trained in)."""
    return next(v.dtype for v in state.values() if torch.is_tensor(v) and v.is_floating_point())


def rebuild(auto_class, config, state: dict, dtype: torch.dtype):
    """A fresh `auto_class` model from `config` in `dtype`, holding the weights of `state` (converted), with its
    tied weights one tensor again. Checks `state` first (check_weights). Its own weights are never initialised:
    that would draw from the global random state, and a run that exports its model inside a checkpoint must
    continue as one that does not."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = auto_class.from_config(copy.deepcopy(config), dtype=dtype)
    model.tie_weights()  # transformers ties in the initialisation skipped above
    check_weights({name: tuple(value.shape) for name, value in state.items()}, model, "the weights")
    groups = tied_groups(model)
    for group in groups:  # one parameter in training: the same values under every name that holds them
        present = [name for name in group if name in state]
        if any(not torch.equal(state[present[0]], state[name]) for name in present[1:]):
            raise ExportError(f"{', '.join(present)} are tied in the model's config but hold different values: "
                              "the trained model was not tied, and a tied export would change it.")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # a tied name left out is filled through its group
    if model.config.tie_word_embeddings:  # transformers 5: tie_weights ties by the config; checked, not assumed
        embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
        if output is not None and output.weight is not embedding.weight:
            raise ExportError("config.tie_word_embeddings is true but the output embedding is not the input one")
    return model.eval()


def tied_groups(model) -> list[list[str]]:
    """Each group of names under which `model` holds one parameter (a tied embedding and lm_head)."""
    tied = tied_parameter_names([model])
    by_parameter: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name in tied:
            by_parameter.setdefault(id(parameter), []).append(name)
    return list(by_parameter.values())


def check_weights(shapes: dict[str, tuple], model, source: str) -> None:
    """Refuse weights (name -> shape) that are not `model`'s: a name it lacks, a shape that differs, or a
    weight missing (a tied name may be missing when another name of its group is there)."""
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    covered = {name for group in tied_groups(model) if any(n in shapes for n in group) for name in group}
    problems = [f"{name} is {tuple(shapes[name])} in {source} and {want} in the model"
                for name, want in expected.items() if name in shapes and tuple(shapes[name]) != want]
    problems += [f"{name} is missing from {source}" for name in expected if name not in shapes and name not in covered]
    problems += [f"{name} is in {source} but not in the model" for name in shapes if name not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ExportError(f"{source} do not fit a {type(model).__name__} built from its config: "
                          f"{'; '.join(problems[:3])}{more}.")


def with_stop_ids(generation_config, stop_ids: tuple[int, ...], pad_token_id: int | None):
    """A copy of `generation_config` whose `eos_token_id` is every stop id (an int when there is one, a list
    otherwise, as the hub's configs write them) and whose pad id is set; its sampling settings are kept."""
    config = copy.deepcopy(generation_config)
    config.eos_token_id = list(stop_ids) if len(stop_ids) > 1 else stop_ids[0]
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id
    config._from_model_config = False  # written here on purpose, not derived from config.json
    return config


# ----------------------------------------------------------------------------- from a checkpoint


def checkpoint_weights(checkpoint: str) -> tuple[str, list[str]]:
    """("safetensors" | "fsdp", the weight paths of [actor, critic if saved]) of a checkpoint directory; a path
    that is not one raises ExportError naming what was expected."""
    if not os.path.isdir(checkpoint):
        raise ExportError(f"{checkpoint} is not a directory; a checkpoint is a directory "
                          "<output_dir>/checkpoints/step_<k>/ written by train.py.")
    is_state = os.path.exists(os.path.join(checkpoint, _RNG_STATE))
    for kind, names in (("safetensors", _WEIGHTS), ("fsdp", _FSDP_WEIGHTS)):
        paths = [os.path.join(checkpoint, n) for n in names if os.path.exists(os.path.join(checkpoint, n))]
        if is_state and paths and paths[0].endswith(names[0]):
            return kind, paths
    hint = ""
    if os.path.exists(os.path.join(checkpoint, "config.json")):
        hint = " It is a model directory already: from_pretrained loads it."
    elif os.path.isdir(os.path.join(checkpoint, "checkpoints")):
        steps = sorted(os.listdir(os.path.join(checkpoint, "checkpoints")))
        hint = f" It is a run's output directory: its checkpoints are {', '.join(steps) or 'none'} under checkpoints/."
    raise ExportError(f"{checkpoint} is not a checkpoint: a checkpoint holds {_RNG_STATE} and {_WEIGHTS[0]} (a "
                      f"1-process or DDP run) or {_FSDP_WEIGHTS[0]}/ (FSDP2).{hint}")


def read_shapes(path: str) -> dict[str, tuple]:
    """Name -> shape of the weights in a safetensors file or an FSDP2 distributed-checkpoint folder, from their
    metadata only (no tensor is read)."""
    if os.path.isdir(path):
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        # accelerate saves {"model": state_dict}: the names carry a leading "model."
        return {name.removeprefix("model."): tuple(m.size) for name, m in metadata.items() if hasattr(m, "size")}
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The full weights of a safetensors file, or merged from an FSDP2 distributed-checkpoint folder the way
    accelerate's `merge_fsdp_weights` does (torch's reader, no process group, whatever the number of shards)."""
    if not os.path.isdir(path):
        from safetensors.torch import load_file

        return load_file(path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner, _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state["model"] if set(state) == {"model"} else state


def run_dir(checkpoint: str) -> str:
    """The output directory of the run that wrote `checkpoint` (`<output_dir>/checkpoints/step_<k>`)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))


def base_model(cfg: Config, output_dir: str) -> tuple[str, object]:
    """(the directory or hub name the run's actor was loaded from, its tokenizer as the run loaded it): the
    config's model.path, or for a task that builds its model (the embedded default, the lab's synthetic tasks)
    its cache entry under trainer.cache_dir or `output_dir` (rlhf.tasks.Task.base_model). Relative paths in the
    config are relative to where train.py ran."""
    from rlhf.tasks import get_task

    task = get_task(cfg.task.name)
    path = task.base_model(cfg, output_dir)
    if path != cfg.model.path and not os.path.isdir(path):
        raise ExportError(f"the run's base model (task {cfg.task.name}, for its architecture and tokenizer) is not "
                          f"at {path}: run this command from the directory train.py ran in (trainer.cache_dir="
                          f"{cfg.trainer.cache_dir} is relative to it), or rebuild the cache with that config's "
                          "train.py.")
    try:
        return path, task.load_tokenizer(path)
    except OSError as e:
        raise ExportError(f"the run's base model {path} (for its architecture and tokenizer) cannot be loaded: "
                          f"{e}") from None


def export_checkpoint(checkpoint: str, out: str, config_path: str | None = None, critic: bool | None = None,
                      dtype: str | None = None) -> str:
    """Write the model of `checkpoint` to `out`, as the run would have at that step (write_model); returns
    `out`. The architecture and tokenizer come from the run's config (`config_path`, by default the
    config.yaml in the run's output directory); `critic` and `dtype` default to its trainer.export_critic and
    trainer.export_dtype. Checks that the checkpoint holds that config's model before any weight is read."""
    from transformers import AutoConfig, GenerationConfig

    kind, weights = checkpoint_weights(checkpoint)
    output_dir = run_dir(checkpoint)
    config_path = config_path or os.path.join(output_dir, "config.yaml")
    if not os.path.exists(config_path):
        raise ExportError(f"no run config at {config_path}: train.py writes it into the run's output directory, "
                          "two levels above its checkpoints. Pass the run's config.yaml with --config.")
    cfg = load_config(config_path)
    critic = cfg.trainer.export_critic if critic is None else critic
    if critic and len(weights) < 2:
        raise ExportError(f"{checkpoint} holds no critic (its run has {_run_info(checkpoint)}); export the policy "
                          "alone (without --critic).")
    dtype = resolve_dtype(dtype or cfg.trainer.export_dtype) if (dtype or cfg.trainer.export_dtype) else None
    path, tokenizer = base_model(cfg, output_dir)
    config = AutoConfig.from_pretrained(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # a model without generation_config.json: transformers derives one from its config
        generation_config = GenerationConfig.from_model_config(config)
    parts = [("the policy", weights[0], config, "causal")]
    if critic:
        parts.append(("the critic", weights[1], critic_config(cfg.model.critic_path or path), "value"))
    lora = cfg.model.lora
    # A LoRA checkpoint holds the adapters (adapted models' trainable weights) only: their base comes from the
    # run's model path, and write_model's rebuild checks the merged weights instead.
    adapted = [bool(lora.rank), bool(lora.rank and lora.critic)]
    _check_fits([part for part, lora_part in zip(parts, adapted) if not lora_part], checkpoint, config_path)
    stop_ids = stop_token_ids(SimpleNamespace(generation_config=generation_config), tokenizer)

    def weights_of(i: int) -> dict:
        if not adapted[i]:
            return read_weights(weights[i])
        from rlhf.models import load_causal_lm, load_critic

        base = (load_causal_lm(path) if i == 0 else load_critic(cfg.model.critic_path or path)).state_dict()
        return merged_state({**base, **read_weights(weights[i])}, lora.alpha / lora.rank)

    critic_part = (parts[1][2], weights_of(1)) if critic else None
    write_model(out, config, weights_of(0), tokenizer, generation_config, stop_ids, dtype, critic_part)
    return out


def _check_fits(parts, checkpoint: str, config_path: str) -> None:
    """Each (what, weights path, config, kind) of the checkpoint against a model built on the meta device from
    the run's config (no memory, no weights read): a checkpoint of another run is refused, naming the config."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    for what, path, config, kind in parts:
        auto_class = AutoModelForCausalLM if kind == "causal" else AutoModelForTokenClassification
        with torch.device("meta"):
            model = auto_class.from_config(copy.deepcopy(config))
        try:
            check_weights(read_shapes(path), model, f"the weights of {what} in {checkpoint}")
        except ExportError as e:
            raise ExportError(f"{e} The checkpoint was written by a run of another config than {config_path}: "
                              "pass that run's config.yaml with --config.") from None


def _run_info(checkpoint: str) -> str:
    try:
        with open(os.path.join(checkpoint, RUN_INFO)) as f:
            return f"algorithm.adv_estimator={json.load(f)['adv_estimator']}"
    except (OSError, KeyError, ValueError):
        return "no critic"


def cli(argv: list[str] | None = None) -> int:
    """`python -m rlhf.export <checkpoint> <out>`; returns the exit status (2 for a path or config refused)."""
    parser = argparse.ArgumentParser(prog="python -m rlhf.export", description=(
        "Write a checkpoint's model as a Hugging Face directory (from_pretrained loads it): 1-process, DDP and "
        "FSDP2 checkpoints alike."))
    parser.add_argument("checkpoint", help="a checkpoint directory, <output_dir>/checkpoints/step_<k>")
    parser.add_argument("out", help="the model directory to write (replaced if it exists)")
    parser.add_argument("--config", help="the run's config.yaml (default: <output_dir>/config.yaml of the run)")
    parser.add_argument("--critic", action=argparse.BooleanOptionalAction, default=None,
                        help="also export the critic into <out>/critic (default: the run's trainer.export_critic)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the exported weights' dtype (default: the run's trainer.export_dtype, else as trained)")
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(args.checkpoint, args.out, args.config, args.critic, args.dtype)
    except (ExportError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
