"""What only a CUDA device can check: bf16 autocast's logits against float32 on the CPU, the exact KL against its
CPU result, the sampler's distribution on the device's generator, and the two decoding loops on the device.
Every test here is marked `cuda`: deselected unless `-m cuda` (tests/conftest.py); bench/gpu_check.py runs them on a
GPU machine (`python -m pytest -q -m cuda tests/test_cuda.py` does the same by hand)."""

import pytest
import torch
from helpers import sample, tiny_qwen2

from rlhf import decode
from rlhf.core_algos import logprobs_from_logits
from rlhf.kl import full_kl
from rlhf.rollout import SamplingParams, left_pad, next_token

pytestmark = pytest.mark.cuda
EOS, PAD = 1, 0
CUDA = torch.device("cuda")


def model_on(device, **config):
    return tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True, **config).to(device)


def test_bf16_autocast_logprobs_on_cuda_match_float32_on_cpu():
    """The trainer's forward under bf16 autocast on the GPU: bf16 logits, float32 log-probs within bf16's rounding
    of the CPU's float32 ones."""
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8], [3, 4], [9, 10, 11]], PAD)
    labels = torch.randint(2, 64, (3, 4), generator=torch.Generator().manual_seed(0))
    cpu_logits = model_on("cpu")(input_ids=prompt_ids, attention_mask=prompt_mask).logits
    with torch.autocast("cuda", dtype=torch.bfloat16):
        gpu_logits = model_on(CUDA)(input_ids=prompt_ids.to(CUDA), attention_mask=prompt_mask.to(CUDA)).logits
    assert gpu_logits.dtype == torch.bfloat16
    gpu = logprobs_from_logits(gpu_logits, labels.to(CUDA))
    assert gpu.dtype == torch.float32
    assert torch.allclose(gpu.cpu(), logprobs_from_logits(cpu_logits, labels), atol=0.05)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_full_kl_on_cuda_equals_its_cpu_result(dtype, atol):
    """Chunked float32 exact KL over a 151,936-token vocabulary: the same numbers on both devices, with gradient."""
    generator = torch.Generator().manual_seed(0)
    logits, ref_logits = (torch.randn(3, 5, 151_936, generator=generator).to(dtype) for _ in range(2))
    cpu_logits = logits.clone().requires_grad_()
    gpu_logits = logits.to(CUDA).requires_grad_()
    cpu = full_kl(cpu_logits, ref_logits, temperature=0.8)
    gpu = full_kl(gpu_logits, ref_logits.to(CUDA), temperature=0.8)
    assert torch.allclose(gpu.cpu(), cpu, atol=atol, rtol=1e-4)
    cpu.sum().backward()
    gpu.sum().backward()
    assert torch.allclose(gpu_logits.grad.float().cpu(), cpu_logits.grad.float(), atol=atol, rtol=1e-3)


def test_sampler_on_cuda_draws_from_the_softmax():
    """20,000 draws of one token from 8 logits on the device's generator: each frequency within 5 binomial
    standard deviations of softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.3], device=CUDA)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    draws = next_token(logits.expand(20_000, 8), SamplingParams(max_new_tokens=1, temperature=0.7), generator)
    counts = torch.bincount(draws, minlength=8).float().cpu()
    probs = torch.softmax(logits.cpu() / 0.7, dim=-1)
    sd = (probs * (1 - probs) / 20_000).sqrt()
    assert ((counts / 20_000 - probs).abs() <= 5 * sd).all()


@pytest.mark.parametrize("autocast", [False, True])
def test_static_decoder_equals_the_reference_loop_on_cuda(autocast):
    """The same tokens and log-probs from both loops on the device, sampling with a device generator, in float32
    and under bf16 autocast. Exact where transformers' own decoding folds the grouped heads into the query
    (`pack_gqa`, transformers 5.2x), as rlhf.decode does; an older transformers copies the cache per head instead
    (5.17 does), and this test then says whether the two kernels' roundings differ."""
    import transformers

    model = model_on(CUDA)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13], [2, 3, 4, 5]] * 4, PAD)
    prompt_ids, prompt_mask = prompt_ids.to(CUDA), prompt_mask.to(CUDA)
    params = SamplingParams(max_new_tokens=40, temperature=0.9)
    out = {}
    for side in ("reference", "static"):
        generator = torch.Generator(device=CUDA).manual_seed(5)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out[side] = sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD, generator,
                               keep_logprobs=True, reference=side == "reference")
        out[side] += (torch.rand(3, generator=generator, device=CUDA),)
    where = f"transformers {transformers.__version__}, autocast {autocast}"
    same = (out["reference"][0] == out["static"][0]).float().mean().item()
    assert same == 1.0, f"{where}: {same:.1%} of the tokens agree"
    assert torch.allclose(out["reference"][1], out["static"][1], atol=1e-5), where
    assert torch.equal(out["reference"][2], out["static"][2])


def test_compiled_step_agrees_with_the_eager_one_on_cuda():
    """torch.compile's step ("reduce-overhead": a CUDA graph) over the whole static cache: greedy tokens equal to the
    reference loop's in float32."""
    model = model_on(CUDA)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13]], PAD)
    prompt_ids, prompt_mask = prompt_ids.to(CUDA), prompt_mask.to(CUDA)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    with torch.no_grad():
        tokens, _ = sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD, reference=True)
        for _ in range(2):  # the second call replays what the first compiled
            how = decode.Decoding(24, lambda logits: next_token(logits, params), 1.0, (EOS,), PAD)
            compiled, _ = decode.decode(model, prompt_ids, prompt_mask, how, step_type=decode.CompiledTokenStep)
            assert torch.equal(tokens, compiled)
