"""Token-budget micro-batches and the padding-free forward (rlmm/trainers/packing.py) on real tiny models.

Each is a different grouping or layout of the same rows, so it must give the same log-probs and the same
update as fixed micro-batches of padded rows, to rounding: the weights after one SGD step (lr 1, no
clipping, so the update is minus the gradient and a mis-scaled micro-batch shows at full size) are
compared on every backend. A packed row must keep its sequences apart (a change in one leaves the
others' log-probs where they were), token budgets must hold and hand rows back in order, and two ranks
whose shares need different numbers of micro-batches must agree on one count (tests/ranks_step.py).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts
from rlmm.trainers.packing import MicroBatching, packed_batch, resized_groups, token_budget_groups
from rlmm.trainers.scoring import padded_rows
from rlmm.trainers.update import minibatch_step
from tests.conftest import build_trainer, torchrun
from tests.test_update import GROUP, OPTIONS, relative_error, sgd_trainer, weights_of

FP32 = SidePrecision("fp32", False)
ROWS = 12
BUDGET = 40  # tokens: 5 micro-batches of 2 or 3 of these rows (8 to 16 tokens each), not 3 of 4


def variable_rollouts(model_path: str, task, rows: int = ROWS, seed: int = 0) -> Rollouts:
    """Real prompts with random responses of 1 to 12 tokens: rows of very different lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples("train", rows)]
    lengths = torch.randint(1, 13, (rows,), generator=generator).tolist()
    responses = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist() for n in lengths]
    return Rollouts(prompt_ids=prompts, response_ids=responses,
                    sampler_logprobs=[torch.zeros(len(r)) for r in responses], finish_reasons=["length"] * rows)


def minibatch_loss(rollouts: Rollouts):
    """A loss of each micro-batch divided by the whole minibatch's response tokens (as rlmm/run/step.py does), with
    an entropy term so that the head's second output reaches the gradient too."""
    advantages = torch.linspace(-1, 1, len(rollouts))
    total = sum(len(r) for r in rollouts.response_ids)

    def loss_fn(rows, logprobs, entropy):
        mask = torch.zeros_like(logprobs, dtype=torch.bool)
        for i, row in enumerate(rows):
            mask[i, :len(rollouts.response_ids[row])] = True
        per_token = advantages[rows][:, None] * logprobs + (0.1 * entropy if entropy is not None else 0.0)
        loss = -torch.where(mask, per_token, 0.0).sum() / total
        return loss, {"loss": loss.item(), "num_tokens": float(mask.sum())}
    return loss_fn


# -- grouping ----------------------------------------------------------------------------------------------

def test_token_budget_groups_hold_the_budget_and_every_row_once():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 80)
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)
        order = [i for g in groups for i in g]  # longest first
        assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
        for count in range(len(groups), len(lengths) + 1):  # what a rank does to reach the agreed count
            more = resized_groups(groups, lengths, count)
            assert len(more) == count and all(more)
            assert sorted(i for g in more for i in g) == list(range(len(lengths)))
            assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in more)
        fewer = resized_groups(groups, lengths, 1)  # the cap: one micro-batch, over the budget
        assert sorted(fewer[0]) == list(range(len(lengths)))


def test_rows_come_back_in_the_rollouts_order(small_model_path, arithmetic_task):
    """Micro-batches under a token budget hold rows longest first; scoring returns them in row order."""
    rollouts = variable_rollouts(small_model_path, arithmetic_task)
    batching = MicroBatching(4, BUDGET, False)
    lengths = [len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
    chunks = batching.split(lengths, list(range(ROWS)))
    assert [i for c in chunks for i in c] != list(range(ROWS)) and len(chunks) > 2
    assert all(sum(lengths[i] for i in c) <= BUDGET for c in chunks)
    fake = [torch.tensor([[float(i)] * 12 for i in c]) for c in chunks]  # each row's log-probs = its index
    out = padded_rows(rollouts, chunks, fake)
    assert [row[0].item() for row in out] == list(range(ROWS))
    trainer = build_trainer("torch", small_model_path, FP32, OPTIONS, micro_batch_size=4)
    try:
        fixed = trainer.logprobs(rollouts)
        trainer.batching = batching
        budgeted = trainer.logprobs(rollouts)
    finally:
        trainer.close()
    assert (budgeted - fixed).abs().max() < 1e-5


@pytest.mark.parametrize("key, value, allowed", [("micro_batch_tokens", 0, "null"), ("micro_batch_tokens", "auto", "null"),
                                                 ("padding_free", "yes", "true or false")])
def test_a_bad_value_is_one_line(small_model_path, key, value, allowed):
    with pytest.raises(ValueError, match=rf"^trainer.{key}: must be .*{allowed}.*got '?{value}'?$"):
        build_trainer("torch", small_model_path, FP32, OPTIONS, **{key: value})


# -- the padding-free forward --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tolerance", [("fp32", 2e-5), ("bf16", 0.1)])
@pytest.mark.parametrize("value_head", [False, True], ids=["policy", "critic"])
def test_padding_free_scores_as_padded(small_model_path, arithmetic_task, dtype, tolerance, value_head):
    """The same rows packed into one row give the padded rows' log-probs (a value model: values) to rounding."""
    rollouts = variable_rollouts(small_model_path, arithmetic_task)
    _, mask = rollouts.padded_sampler_logprobs()
    out = {}
    for padding_free in (False, True):
        torch.manual_seed(0)  # a value model's head is newly initialised: the same one each time
        trainer = build_trainer("torch", small_model_path, SidePrecision(dtype, False), OPTIONS, micro_batch_size=6,
                                padding_free=padding_free, value_head=value_head)
        try:
            out[padding_free] = trainer.logprobs(rollouts)
        finally:
            trainer.close()
    difference = (out[True] - out[False])[mask].abs().max().item()
    print(f"padding-free vs padded, {dtype}, {'critic' if value_head else 'policy'}: max abs diff {difference:.3g}")
    assert difference < tolerance


def test_a_packed_sequence_cannot_see_its_neighbour(small_model_path, arithmetic_task):
    """One packed row of every sequence: changing sequence 5's tokens moves its own log-probs and no other's."""
    rollouts = variable_rollouts(small_model_path, arithmetic_task)
    trainer = build_trainer("torch", small_model_path, FP32, OPTIONS, micro_batch_size=ROWS, padding_free=True)
    try:
        before = trainer.logprobs(rollouts)
        changed = Rollouts([list(p) for p in rollouts.prompt_ids], [list(r) for r in rollouts.response_ids],
                           rollouts.sampler_logprobs, rollouts.finish_reasons)
        changed.prompt_ids[5] = [(t + 1) % 20 + 3 for t in changed.prompt_ids[5]]
        after = trainer.logprobs(changed)
    finally:
        trainer.close()
    batch = packed_batch(rollouts.prompt_ids, rollouts.response_ids)
    assert batch.ids.shape == (1, sum(len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)))
    others = [i for i in range(ROWS) if i != 5]
    assert (after[others] - before[others]).abs().max() <= 1e-6
    assert (after[5] - before[5]).abs().max() > 1e-2


# -- the same update ----------------------------------------------------------------------------------------

MODES = {"token_budget": {"micro_batch_tokens": BUDGET}, "padding_free": {"padding_free": True},
         "both": {"micro_batch_tokens": BUDGET, "padding_free": True}}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("backend", ["torch", "deepspeed", "deepspeed-zero3", "fsdp"])
def test_the_same_update_as_fixed_padded_micro_batches(small_model_path, arithmetic_task, tmp_path, backend, mode):
    """One SGD step on the same 12 rows: fixed micro-batches of 4 padded rows against `mode` (micro-batches of
    other sizes and counts, or packed rows): the same weights to rounding in fp32."""
    rollouts = variable_rollouts(small_model_path, arithmetic_task)
    changes = {}
    for name, values in (("fixed", {}), (mode, MODES[mode])):
        trainer = sgd_trainer(backend, small_model_path, tmp_path, micro_batch_size=4,
                              **values)
        try:
            lengths = [len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
            counts = [len(m) for m in trainer.batching.split(lengths, list(range(ROWS)))]
            before = weights_of(trainer)
            metrics = minibatch_step(trainer, rollouts, list(range(ROWS)), minibatch_loss(rollouts))
            assert metrics["skipped"] == 0
            changes[name] = {k: v - before[k] for k, v in weights_of(trainer).items()}
        finally:
            trainer.close()
        if "micro_batch_tokens" in values:
            assert len(counts) != 3, counts  # another count than the fixed 3 (DeepSpeed counts 3 to a step)
    assert max(v.abs().max().item() for v in changes["fixed"].values()) > 0
    assert relative_error(changes[mode], changes["fixed"]) < 1e-5


# -- two ranks ----------------------------------------------------------------------------------------------

SHARES = {0: [30, 30, 30, 30, 5], 1: [30, 5]}  # tokens of each rank's rows
BUDGETS = (65, 40)  # rank 0 needs 2 and rank 1 1 micro-batch; rank 0 needs 4, more than rank 1's 2 rows


def _split_on_rank(rank: int, out: str) -> None:
    import torch.distributed as dist

    # a file rendezvous: a port picked free here could be taken by another test's process before rank 0 binds it
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    try:
        lengths = SHARES[rank]
        splits = [MicroBatching(4, budget, False).split(lengths, list(range(len(lengths)))) for budget in BUDGETS]
        Path(out, f"{rank}.json").write_text(json.dumps(splits))
    finally:
        dist.destroy_process_group()


def test_ranks_run_as_many_micro_batches_as_the_fewest_rows_allow(tmp_path):
    """Two gloo ranks agree on one count without an empty micro-batch: at 65 tokens rank 1 splits its one
    micro-batch in two to run rank 0's 2; at 40 tokens rank 0 needs 4 but rank 1 holds 2 rows, so both run
    2 and rank 0's exceed the budget (the one case that does, logged)."""
    import torch.multiprocessing as mp

    mp.spawn(_split_on_rank, args=(str(tmp_path),), nprocs=2)
    results = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}
    for case, budget in enumerate(BUDGETS):
        splits = {rank: results[rank][case] for rank in (0, 1)}
        assert len(splits[0]) == len(splits[1]) == 2, splits
        for rank, split in splits.items():
            assert all(split) and sorted(i for m in split for i in m) == list(range(len(SHARES[rank])))
            if budget == 65:
                assert all(sum(SHARES[rank][i] for i in m) <= budget for m in split)


def test_two_ranks_agree_on_the_micro_batch_count(small_model_path, arithmetic_task, tmp_path):
    """torchrun, 2 gloo ranks whose shares need different numbers of micro-batches under the budget: they run
    the same count (ZeRO-3's and FSDP's collectives would otherwise not pair up), and the averaged update
    equals one rank's update on all the rows, on every backend (tests/ranks_step.py)."""
    from safetensors.torch import load_file

    from rlmm.run.step import rank_share
    from tests.ranks_step import BACKENDS, step_on_share
    from tests.test_update import components

    c = components(small_model_path, arithmetic_task, None, None)
    prompts = arithmetic_task.examples("train", 6)
    rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in prompts], n=GROUP)
    c.sampler.close()
    recorded = {"prompts": [e.prompt for e in prompts], "group_size": GROUP, "prompt_ids": rollouts.prompt_ids,
                "response_ids": rollouts.response_ids,
                "sampler_logprobs": [lp.tolist() for lp in rollouts.sampler_logprobs]}
    lengths = [[len(rollouts.prompt_ids[i]) + len(rollouts.response_ids[i])
                for p in rank_share(list(range(6)), rank, 2) for i in range(p * GROUP, (p + 1) * GROUP)]
               for rank in (0, 1)]
    # The largest budget under which the ranks' own shares need different counts, so they must agree.
    tokens = max(b for b in range(16, 200) if len({len(token_budget_groups(share, b)) for share in lengths}) > 1)
    budget = {"micro_batch_tokens": tokens}
    replay = tmp_path / "rollouts.json"
    replay.write_text(json.dumps(recorded))
    torchrun(["tests/ranks_step.py", small_model_path, str(replay), str(tmp_path), json.dumps(budget)], timeout=200)
    initial = load_file(Path(small_model_path) / "model.safetensors")
    for backend in BACKENDS:
        one = {k: v - initial[k] for k, v in step_on_share(small_model_path, recorded, backend, tmp_path,
                                                           **budget).items()}
        two = {k: v - initial[k] for k, v in load_file(tmp_path / f"{backend}-2.safetensors").items()}
        assert max(v.abs().max().item() for v in one.values()) > 0
        assert relative_error(two, one) < 1e-4, backend
