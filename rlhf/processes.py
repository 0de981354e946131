"""Work over several processes: reductions over processes, each process's share of a batch and of the
evaluation, and stopping the decoding together under sharded weights (FSDP).

    one_process, sum_over_processes    the `reduce_sum` that functions needing whole-batch statistics take
    mean_over_processes                per-process metrics -> their mean (max / min for keys ending so)
    token_weighted_means               per-process token means -> means over all processes' tokens
    process_share, eval_batches        which rows of the global batch and of the held-out set are this process's
    stop_together, stop_rule           generate's `all_finished` under FSDP
    launch_warnings                    why `accelerate launch` asked for several processes started one

Functions that need statistics of the whole global batch (here, in rlhf.step and in rlhf.core_algos) take
`reduce_sum`, a function that sums a tensor over processes (`sum_over_processes(accelerator)` in rlhf/step.py);
the default, `one_process`, is the identity. So the function the tests check is the function the trainer
calls, whatever the world size (the tests run N processes as N threads).
"""

from __future__ import annotations

from typing import Callable

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def one_process(tensor: torch.Tensor) -> torch.Tensor:
    """The cross-process sum when there is one process."""
    return tensor


def sum_over_processes(accelerator) -> ReduceSum:
    """The cross-process sum, as the `reduce_sum` argument of the functions that take one."""
    return lambda tensor: accelerator.reduce(tensor, "sum")


def mean_over_processes(accelerator, metrics: dict) -> dict[str, float]:
    """Per-process numbers (floats or 0-dim tensors) -> their mean over processes (max / min for keys ending so)."""
    stacked = torch.tensor([float(v) for v in metrics.values()], dtype=torch.float32, device=accelerator.device)
    reduced = accelerator.reduce(stacked, "mean")
    is_max, is_min = ([key.endswith(suffix) for key in metrics] for suffix in ("/max", "/min"))
    if any(is_max) or any(is_min):
        gathered = accelerator.gather(stacked[None])  # (processes, keys)
        reduced = torch.where(torch.tensor(is_max, device=reduced.device), gathered.amax(dim=0), reduced)
        reduced = torch.where(torch.tensor(is_min, device=reduced.device), gathered.amin(dim=0), reduced)
    return dict(zip(metrics, reduced.tolist()))


def token_weighted_means(local_means: dict[str, float], num_tokens: torch.Tensor,
                         reduce_sum: ReduceSum = one_process) -> dict[str, float]:
    """Per-process token means -> means over all processes' tokens (not the mean of the means)."""
    weight = num_tokens.float().reshape(1)
    stacked = torch.tensor(list(local_means.values()), dtype=torch.float32, device=weight.device)
    totals = reduce_sum(torch.cat([stacked * weight, weight]))
    return dict(zip(local_means, (totals[:-1] / totals[-1].clamp(min=1)).tolist()))


def process_share(global_indices: list[int], rank: int, world: int) -> list[int]:
    """This process's contiguous share of the global batch (validation made the sizes divide)."""
    share = len(global_indices) // world
    return global_indices[rank * share:(rank + 1) * share]


def eval_batches(num_rows: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This process's held-out rows (a contiguous share, the first processes one larger when the sizes do not
    divide) in batches of at most batch_size. Every process gets the same number of batches, the last ones
    possibly empty: with sharded weights (FSDP) each forward is collective, so a process that ran out of rows
    must still take part (it decodes a stand-in row and discards it)."""
    share = -(-num_rows // world)  # ceil
    mine = list(range(rank * share, min((rank + 1) * share, num_rows)))
    return [mine[start:start + batch_size] for start in range(0, share, batch_size)]


def stop_together(reduce_sum: ReduceSum) -> Callable[[torch.Tensor], bool]:
    """generate's `all_finished` for sharded weights (FSDP): every forward pass is collective, so all processes
    must decode the same number of tokens. True once the sequences of every process have stopped."""
    return lambda finished: reduce_sum((~finished).sum()).item() == 0


def stop_rule(accelerator):
    """generate's `all_finished`: the processes stop together under FSDP, else (None) each on its own."""
    # Imported here: rlhf.core_algos imports this module, and importing it stays free of accelerate's ~1 s.
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    return stop_together(sum_over_processes(accelerator))


def launch_warnings(environ, num_processes: int) -> list[str]:
    """Why a launch asked for several processes started one: accelerate's simple launcher (what `accelerate launch`
    falls back to with `--cpu`, or without `--multi_gpu` or a multi-process config where there are < 2 GPUs) runs
    the script once, and sets MASTER_ADDR and MASTER_PORT only when asked for `--num_processes` > 1 or
    `--num_machines` > 1 (accelerate 1.15, utils/launch.py, prepare_simple_launcher_cmd_env), while torchrun, its
    multi-process launcher, sets WORLD_SIZE for every process. So: accelerate's variables (ACCELERATE_USE_CPU,
    which every launch of it sets) and MASTER_ADDR, no WORLD_SIZE, and one process. `environ` is os.environ."""
    if num_processes > 1 or "WORLD_SIZE" in environ or not {"ACCELERATE_USE_CPU", "MASTER_ADDR"} <= set(environ):
        return []
    why = ("--cpu sends every launch to it (accelerate refuses --cpu with --multi_gpu)"
           if environ["ACCELERATE_USE_CPU"].lower() in ("1", "true", "yes") else
           "without --multi_gpu (or a config file saying MULTI_GPU or FSDP) on a machine with fewer than 2 GPUs "
           "accelerate picks it")
    return [f"accelerate launch was asked for several processes but started one: this process is alone (no "
            f"WORLD_SIZE), so the run trains as 1 process. accelerate's simple launcher runs the script once, and "
            f"{why}. For N processes on a CPU: accelerate launch --multi_gpu --num_processes N train.py ... "
            "(accelerate's name; train.py runs them on the CPU over gloo), or --config_file "
            "configs/accelerate/ddp.yaml or fsdp.yaml (docs/gpu.md#several-processes-on-a-cpu)."]

