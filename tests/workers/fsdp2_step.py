"""One training step of a patched BERT masked LM under FSDP2 (``fully_shard`` per block and the
root), each rank on its half of the global batch, against the stock model in one process on the
whole batch: the loss averaged over ranks and every gradient (all-gathered) within 1e-5 in fp32,
dropout off. Run by tests/test_fsdp2.py under ``torchrun --nproc_per_node 2`` (gloo, CPU)."""

import copy
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from tempo import apply_tempo
from tempo.integrations.recompute import transformer_blocks
from tempo.plan.probe import masked_lm_labels


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=500, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    stock = transformers.BertForMaskedLM(config).train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2 * world, 32), generator=generator)
    batch = {"input_ids": ids, "labels": masked_lm_labels(ids)}  # the same labelled count in every row

    stock_loss = stock(**batch).loss
    stock_loss.backward()
    reference = {name: p.grad for name, p in stock.named_parameters()}

    model = apply_tempo(copy.deepcopy(stock)).train()
    model.zero_grad(set_to_none=True)
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    rows = slice(2 * rank, 2 * rank + 2)
    out = model(**{k: v[rows] for k, v in batch.items()})
    assert out.logits is None  # the fused head ran: no logits formed
    loss = out.loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    # Each gradient within 1e-5 of its own largest value; the key biases' gradients are 0 up to rounding
    # (softmax does not see a constant per query), held to 1e-6 of the largest gradient instead.
    largest = max(g.abs().max().item() for g in reference.values())
    worst = 0.0
    for name, p in model.named_parameters():
        error = (p.grad.full_tensor() - reference[name]).abs().max().item()
        worst = max(worst, error / (1e-5 * reference[name].abs().max().item() + 1e-6 * largest))
        if error > 1e-5 * reference[name].abs().max().item() + 1e-6 * largest and rank == 0:
            print(f"{name}: error {error:.2e}", flush=True)
    loss_error = abs(mean.item() - stock_loss.item()) / abs(stock_loss.item())
    if rank == 0:
        print(f"done: loss {mean.item():.6f} (stock, one process: {stock_loss.item():.6f}), relative error "
              f"{loss_error:.2e}; gradients: worst error {worst:.2f} of the tolerance", flush=True)
    dist.destroy_process_group()
    return 0 if loss_error < 1e-5 and worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
