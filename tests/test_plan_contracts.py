"""The planner's counting contracts, each with an oracle that does not share the code under test
(issue 43): the allocator's rounding written out by hand, a peak summed from the tensors a step
holds, the longest length the stock model itself accepts, the candidates' order spelled out, and a
measured rate read against a clock the test controls."""

import importlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the hf extra; CI installs it

from tempo.plan.planner import recompute_candidates  # noqa: E402
from tempo.plan.probe import max_positions  # noqa: E402
from tempo.plan.trace import CUDA_BLOCK, MemoryTimeline  # noqa: E402

confirm = importlib.import_module("tempo.plan.confirm")  # the module (tempo.plan.confirm is also a function's name)


@pytest.mark.parametrize("nbytes, counted", [(0, 0), (1, 512), (4, 512), (511, 512), (512, 512), (513, 1024),
                                             (1536, 1536), (1537, 2048)])
def test_a_gpu_timeline_rounds_every_allocation_up_to_the_allocators_block(nbytes, counted):
    """The CUDA caching allocator hands out whole 512-byte blocks: a storage of n bytes costs
    ceil(n / 512) · 512, never less (rounding down would make every GPU plan count short)."""
    assert CUDA_BLOCK == 512
    timeline = MemoryTimeline(CUDA_BLOCK)
    with timeline:
        kept = torch.empty(nbytes, dtype=torch.uint8)
    timeline.stop()
    assert [a.nbytes for a in timeline.allocations] == [counted]
    assert timeline.segments[("fwd", 0)].peak == counted
    del kept


def test_an_ops_inputs_are_alive_when_its_outputs_are_made():
    """An op's last-use input dies only after the op returns: the peak counts the temporary input and
    the output together (4 KB ones + 4 KB temporary + 4 KB output), not the output alone after the
    input has gone."""
    timeline = MemoryTimeline()
    with timeline:
        ones = torch.ones(1024)
        out = torch.exp(ones * 2)  # the product is a temporary: dead once exp has returned
    timeline.stop()
    assert timeline.segments[("fwd", 0)].peak == 3 * 4096
    assert timeline.live == 2 * 4096  # the temporary was freed, after the peak
    del ones, out


@pytest.mark.parametrize("make, prefix", [(transformers.BertConfig, "Bert"), (transformers.RobertaConfig, "Roberta")])
def test_the_position_limit_is_the_longest_length_the_stock_model_accepts(make, prefix):
    """RoBERTa's positions start at padding_idx + 1: a table of 20 serves 20 − 2 = 18 tokens. The
    oracle is the stock model: the limit runs, one more token raises."""
    config = make(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=20, pad_token_id=1)
    model = getattr(transformers, f"{prefix}Model")(config).eval()
    limit = max_positions(model)
    with torch.no_grad():
        model(input_ids=torch.full((1, limit), 5))
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=torch.full((1, limit + 1), 5))


def test_the_recompute_candidates_in_order():
    """none; "selective" on 1..L blocks (spread); then "full" on 1..L with every other block
    selective (when selective is available), else none: spelled out for L = 3."""
    n, s, f = "none", "selective", "full"
    assert recompute_candidates(3, ("none", "selective", "full")) == [
        (n, n, n), (n, n, s), (n, s, s), (s, s, s), (s, s, f), (s, f, f), (f, f, f)]
    assert recompute_candidates(3, ("none", "full")) == [(n, n, n), (n, n, f), (n, f, f), (f, f, f)]
    assert recompute_candidates(2, ("none",)) == [(n, n)]


def test_the_measured_rate_counts_every_timed_step(monkeypatch):
    """DefaultMeasure's tokens/s is the real tokens of all ``steps`` timed steps over their time, on a
    clock the test controls (2 s between the two reads confirm.py makes): 3 steps of T tokens -> 3T / 2."""
    real_clock = confirm.time.perf_counter
    readings = iter([100.0, 102.0])

    def clock():
        return next(readings) if sys._getframe(1).f_globals.get("__name__") == confirm.__name__ else real_clock()

    monkeypatch.setattr(confirm.time, "perf_counter", clock)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)

    def batch(tokens):
        ids = torch.full((tokens // 8, 8), 5)
        return {"input_ids": ids, "labels": ids}

    measure = confirm.DefaultMeasure(batch, steps=3, device="cpu")
    result = measure(lambda: transformers.BertForMaskedLM(config), 32)
    assert result.real_tokens == 32 and result.tokens_per_second == pytest.approx(3 * 32 / 2.0)


# -- round 6's contracts (tests/test_mutation_round5.py has round 5's) ------------------------------
@pytest.mark.parametrize("length, labelled", [(3, 1), (10, 2), (20, 3), (128, 19), (512, 77)])
def test_a_masked_lm_batch_labels_fifteen_percent_of_each_row_rounded_to_nearest(length, labelled):
    """masked_lm_labels: round(0.15 * length) positions per row (at least one), spread from the first
    to the last, labelled with their token; -100 elsewhere."""
    from tempo.plan.probe import masked_lm_labels

    ids = torch.arange(2 * length).reshape(2, length) + 5
    labels = masked_lm_labels(ids)
    kept = labels != -100
    assert kept.sum(dim=1).tolist() == [labelled, labelled]
    assert torch.equal(labels[kept], ids[kept]) and bool(kept[:, 0].all())
    assert bool(kept[:, -1].all()) == (labelled > 1)


def test_a_budget_of_exactly_a_flat_lines_start_holds_it_and_one_byte_less_does_not():
    """largest_tokens: a line a + b·t with b = 0 (the optimizer step's peak, flat in the tokens) fits a
    budget of exactly int(a) bytes; the growing line then decides."""
    from tempo.plan.planner import largest_tokens

    flat, growing = (1000.25, 0.0), (100.0, 3.0)
    assert largest_tokens([flat, growing], 1000) == 300
    assert largest_tokens([flat, growing], 999) == 0
    assert largest_tokens([(1000.0, 0.0), growing], 1000) == 300


def test_confirms_cpu_peak_counts_the_optimizer_states_present_before_the_step():
    """_tracked_peak: the states an optimizer holds are part of the step's memory. An optimizer that
    only holds a state of n bytes per parameter (no temporaries): the peak moves by exactly n."""
    from torch import nn

    class Holding(torch.optim.Optimizer):
        def __init__(self, params, nbytes):
            super().__init__(params, {"lr": 0.0})  # TrainStep reads the learning rate
            self.nbytes = nbytes

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if "held" not in self.state[p]:  # made once, in the warm-up step
                        self.state[p]["held"] = torch.zeros(self.nbytes // 4)

    def peak(nbytes: int) -> int:
        torch.manual_seed(0)
        model = nn.Linear(64, 64, bias=False).train()
        optimizer = Holding(model.parameters(), nbytes)
        step = confirm.TrainStep(model, optimizer, lambda m, b: m(*b).square().mean(), "fp32", torch.device("cpu"),
                                 max_grad_norm=None, measure_activations=False)
        batch = (torch.randn(8, 64),)
        step([batch])  # the warm-up step makes the state
        return confirm._tracked_peak(model, optimizer, step, batch)

    assert peak(4 << 20) - peak(4) == (4 << 20) - 4


def test_the_kernel_paths_scratch_counts_the_weight_blocks_cast():
    """scratch_bytes(kernel=True), by construction: the rows in the GEMM's dtype, 96 bytes of vectors
    per row, the weight block's cast when the weight's dtype is not the GEMM's, the block's logits."""
    from tempo.ops.linear_cross_entropy import scratch_bytes

    rows, vocab, hidden, block = 100, 5000, 64, 256
    for weight_dtype, cast in ((torch.float32, block * hidden * 2), (torch.bfloat16, 0)):
        assert scratch_bytes(rows, vocab, hidden, block, torch.float32, weight_dtype, torch.bfloat16, False, False,
                             kernel=True) == rows * hidden * 2 + 96 * rows + cast + rows * block * 2


@pytest.mark.parametrize("device, kernels", [("h100", True), ("cpu", False)])
def test_a_plan_counts_the_fused_ops_inside_on_the_path_its_device_runs(device, kernels, monkeypatch):
    """trace_step: a CUDA plan adds the Triton path's scratch at the fused head's ops, a CPU plan the
    reference path's (the flag the timeline passes to SCRATCH)."""
    import tempo.plan as tp
    from tempo.plan import band
    from tempo.plan import trace as trace_module

    seen = []
    spied = {packet: (lambda f: lambda args, kernel: seen.append(kernel) or f(args, kernel))(fn)
             for packet, fn in trace_module.SCRATCH.items()}
    monkeypatch.setattr(trace_module, "SCRATCH", spied)
    tp.count(band.small_model("llama-3.2-1b", "causal-lm"), 64, device=device, precision="bf16", modes=("none",))
    assert seen and set(seen) == {kernels}


@pytest.mark.parametrize("family, head, lengths, expected", [
    ("deberta-v3-large", "classification", [64] * 4, {"padded": True, "ragged": False, "packed": False}),
    ("deberta-v3-large", "classification", [64, 30, 17], {"padded": True, "ragged": True, "packed": False}),
    ("bert-large", "mlm", [64, 30, 17], {"padded": False, "packed": True}),
])
def test_the_probe_batch_is_the_collators(family, head, lengths, expected, monkeypatch):
    """The planner traces what a collator gives the model: a padded model the mask of a padded batch
    (ragged only when the lengths vary), a padding-free one position_ids per row and no mask."""
    import tempo.plan as tp
    from tempo.plan import band
    from tempo.plan import planner

    calls = []
    real = planner.example_batch
    monkeypatch.setattr(planner, "example_batch", lambda *a, **k: calls.append(k | {"padded": a[3]}) or real(*a, **k))
    tp.count(band.small_model(family, head), lengths, device="cpu", precision="fp32", modes=("none",))
    assert calls and all(expected.items() <= call.items() for call in calls), calls


@pytest.mark.parametrize("ragged", [False, True])
def test_example_batch_masks_a_padded_batch_as_a_collator_does(ragged):
    from tempo.plan import band
    from tempo.plan.probe import example_batch

    model = band.small_model("deberta-v3-large", "classification")
    batch = example_batch(model, 3, 16, padded=True, ragged=ragged)
    assert int(batch["attention_mask"].sum()) == 3 * 16 - (3 if ragged else 0)
    assert bool((batch["attention_mask"][:, -1] == 0).all()) == ragged
