"""The unpadded model against the padded one over padding side x train/eval x dropout (issue 26.5).

Where no dropout can act (dropout 0, or eval mode with dropout 0.1), the unpadded and the padded
model give the same loss and gradients: a wrong position for left-padded rows, or dropout left on
in eval, shows up here. With dropout acting (train, 0.1), the masks differ by construction (tokens
move), so only what must hold either way is checked: dropout changes the result, the model trains."""

import pytest
import torch

from tempo.bert.config import BertConfig
from tempo.bert.model import BertForPreTraining
from tempo.choices import TempoChoice


def _config(dropout):
    config = BertConfig.from_name("bert_tiny")
    config.vocab_size = 128
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
    return config


def _batch(side):
    g = torch.Generator().manual_seed(0)
    lengths = [12, 7, 3, 10]
    b, l = len(lengths), 12
    ids = torch.randint(5, 128, (b, l), generator=g)
    mask = torch.zeros(b, l, dtype=torch.int64)
    positions = torch.zeros(b, 2, dtype=torch.int64)
    for row, n in enumerate(lengths):
        start = 0 if side == "right" else l - n
        mask[row, start:start + n] = 1
        positions[row] = torch.tensor([start + 1, start + n - 1])  # two real tokens per row
    ids = ids * mask
    labels = torch.gather(ids, 1, positions)
    batch = dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=mask,
                 masked_lm_positions=positions, masked_lm_labels=labels)
    if side == "right":
        # NSP only right-padded: the padded model's pooler reads position 0 (DLE's layout), which
        # left padding makes a padding token; the unpadded model reads each row's first real token.
        batch["next_sentence_labels"] = torch.tensor([0, 1, 1, 0])
    return batch


def _run(model, batch, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _pair(choice, dropout, mode):
    torch.manual_seed(0)
    padded = BertForPreTraining(_config(dropout), choice, unpad=False)
    unpadded = BertForPreTraining(_config(dropout), choice, unpad=True)
    unpadded.load_state_dict(padded.state_dict())
    for model in (padded, unpadded):
        model.train(mode == "train")
    return padded, unpadded


# Every (dropout, mode) where no dropout acts; (0.1, train) is test_dropout_acts_on_the_unpadded_model.
NO_DROPOUT_ACTS = [(0.0, "train"), (0.0, "eval"), (0.1, "eval")]


@pytest.mark.parametrize("choice", [TempoChoice.default(), TempoChoice.none("eager")], ids=["tempo", "stock"])
@pytest.mark.parametrize("dropout,mode", NO_DROPOUT_ACTS, ids=[f"p{p}-{m}" for p, m in NO_DROPOUT_ACTS])
@pytest.mark.parametrize("side", ["right", "left"])
def test_unpadded_equals_padded_wherever_no_dropout_acts(side, dropout, mode, choice):
    padded, unpadded = _pair(choice, dropout, mode)
    batch = _batch(side)
    loss_p, grads_p = _run(padded, batch)
    loss_u, grads_u = _run(unpadded, batch)
    torch.testing.assert_close(loss_u, loss_p, rtol=1e-5, atol=1e-6)
    assert grads_u.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_u[name], grads_p[name], rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("side", ["right", "left"])
def test_dropout_acts_on_the_unpadded_model(side):
    _, unpadded = _pair(TempoChoice.default(), 0.1, "train")
    batch = _batch(side)
    first, second = _run(unpadded, batch, seed=1)[0], _run(unpadded, batch, seed=2)[0]
    assert torch.isfinite(first) and not torch.equal(first, second)
    unpadded.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        a = unpadded(**batch).loss
        torch.manual_seed(2)
        b = unpadded(**batch).loss
    assert torch.equal(a, b)  # eval: no dropout, whatever the RNG
