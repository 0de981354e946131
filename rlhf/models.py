"""Loading the tokenizer, the policy and the critic by hub name or local path (one code path).

    tokenizer = load_tokenizer(path)                 # left-padded, pad token guaranteed
    policy = load_causal_lm(path, "bfloat16")
    critic = load_critic(path, "float32")            # same backbone, scalar value head, values 0 at start

The critic is the causal LM's backbone with a one-output token-classification head, as in TRL and verl:
`AutoModelForTokenClassification` loads the backbone weights from a causal-LM checkpoint (Qwen2, Llama,
...) and adds a fresh `score` head, which we zero so the first value estimates are exactly 0.
"""

from __future__ import annotations

import logging
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlhf.tracking import log_filter

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # model.dtype, model.ref_dtype; the torch dtypes of the same names


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16; torch dtypes pass through. Unknown names raise ValueError."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, dtype)


def load_tokenizer(path_or_name: str):
    """AutoTokenizer with a pad token (the EOS token if it has none) and left padding, so that batched
    prompts end where generation starts."""
    tokenizer = AutoTokenizer.from_pretrained(path_or_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(path_or_name: str, dtype: str | torch.dtype = "float32"):
    """The policy (or the frozen reference): AutoModelForCausalLM in `dtype`."""
    return AutoModelForCausalLM.from_pretrained(path_or_name, dtype=resolve_dtype(dtype))


def critic_config(path_or_name: str):
    """The value model's config: the causal LM's, with one output and no dropout before the head (see
    load_critic). rlhf.export rebuilds a trained critic from it."""
    config = AutoConfig.from_pretrained(path_or_name, num_labels=1)
    config.classifier_dropout = 0.0
    return config


def load_critic(path_or_name: str, dtype: str | torch.dtype = "float32"):
    """A value model: the causal LM's backbone plus a new scalar head, zero-initialised (values start at 0).

    Dropout before the head is switched off (transformers defaults it to 0.1): values computed in train
    mode must equal those computed in eval mode, or value clipping compares noise.
    """
    config = critic_config(path_or_name)
    with log_filter("transformers.modeling_utils", _LoadReportFilter()):  # its load report, checked below
        critic, info = AutoModelForTokenClassification.from_pretrained(
            path_or_name, config=config, dtype=resolve_dtype(dtype), output_loading_info=True)
    head_name = "score" if hasattr(critic, "score") else "classifier"
    head = getattr(critic, head_name)
    # A causal-LM checkpoint has an LM head the value model does not use and no value head (made here): that is
    # what transformers' load report lists at every start. Anything else is worth a warning.
    missing = [k for k in info["missing_keys"] if k.split(".")[0] != head_name]
    unused = [k for k in info["unexpected_keys"] if not k.startswith("lm_head.")]
    if missing or unused:
        warnings.warn(f"critic from {path_or_name}: weights newly initialised {missing or 'none'}, checkpoint "
                      f"weights not used {unused or 'none'} (expected: only the value head new, only lm_head "
                      "unused)", stacklevel=2)
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    return critic


# How transformers words its report of missing and unused weights: one table in 5.x, two sentences in 4.x.
_LOAD_REPORT = ("LOAD REPORT", "were not initialized from the model checkpoint", "were not used when initializing")


class _LoadReportFilter(logging.Filter):
    """Holds back transformers' report of missing and unused weights (a warning of transformers.modeling_utils)
    while a critic loads from a causal-LM checkpoint: load_critic checks the same lists itself and warns only
    when they hold more than the LM head and the value head. Any other message still gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(words in message for words in _LOAD_REPORT)
