"""rlhf/processes.py: the reductions over processes and each process's share of the work, with N processes
run as N threads (helpers.in_processes), so they are checked against what one process holding the whole
batch computes."""

import copy

import pytest
import torch
from helpers import in_processes, tiny_qwen2

from rlhf.processes import eval_batches, process_share, stop_together, token_weighted_means
from rlhf.rollout import SamplingParams, generate, left_pad

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_weighted_means_weight_processes_by_their_tokens():
    shards = [({"a": 1.0, "b": 10.0}, torch.tensor(1)), ({"a": 4.0, "b": 0.0}, torch.tensor(3))]
    means = in_processes(lambda s, reduce_sum: token_weighted_means(*s, reduce_sum), shards)
    assert means[0] == means[1] == pytest.approx({"a": (1 + 12) / 4, "b": 10 / 4})


def test_process_share_splits_the_global_batch_in_order():
    indices = [5, 3, 9, 1, 0, 2]
    assert [process_share(indices, rank, 3) for rank in range(3)] == [[5, 3], [9, 1], [0, 2]]
    assert process_share(indices, 0, 1) == indices


def test_eval_batches_cover_the_held_out_set_once_in_the_same_number_of_batches_everywhere():
    assert [eval_batches(7, 3, rank, 2) for rank in range(2)] == [[[0, 1, 2], [3]], [[4, 5, 6], []]]
    assert eval_batches(5, 8, 0, 1) == [[0, 1, 2, 3, 4]]
    for num_rows, batch_size, world in [(7, 2, 3), (1, 4, 3), (256, 128, 2), (10, 3, 4), (9, 9, 2)]:
        batches = [eval_batches(num_rows, batch_size, rank, world) for rank in range(world)]
        assert len({len(b) for b in batches}) == 1, batches  # FSDP: the same number of forwards everywhere
        rows = [row for per_process in batches for batch in per_process for row in batch]
        assert rows == list(range(num_rows))  # each held-out row once
        assert all(len(batch) <= batch_size for per_process in batches for batch in per_process)


def test_stop_together_decodes_until_every_process_has_stopped():
    """Two processes whose prompts stop at different lengths (the greedy model of tests/test_rollout.py, EOS
    1: the first prompt's response stops after 3 tokens, the second's runs to the limit). With stop_together both
    run the same number of forward passes, as FSDP's collective forwards require; the tokens are unchanged."""
    model = tiny_qwen2(16, seed=2, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.5)
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 1})
    params = SamplingParams(max_new_tokens=20, greedy=True)
    shards = [left_pad([[13]], 0), left_pad([[3, 4, 5, 6, 7]], 0)]

    def decode(shard, all_finished):
        # One model per process, each counting its decoding steps: the calls of its output layer, one per token
        # whether the reference loop runs the whole model or rlhf.decode's step runs its layers.
        forwards, mine = [], copy.deepcopy(model)
        mine.get_output_embeddings().register_forward_hook(lambda *args: forwards.append(1))
        return generate(mine, tokenizer, *shard, params, all_finished=all_finished).response_ids, len(forwards)

    alone = [decode(shard, None) for shard in shards]
    together = in_processes(lambda shard, reduce_sum: decode(shard, stop_together(reduce_sum)), shards)
    assert alone[0][1] < alone[1][1] == 20, "the case needs one process to stop early"
    assert together[0][1] == together[1][1] == 20
    for (ours, _), (theirs, _) in zip(together, alone):
        assert torch.equal(ours, theirs)
