"""The greedy selector (flexsparse.integrations.calibration.greedy_scores) on a tiny random Llama, CPU.

Its costs are measured through the gated attention at gates 0 / 1; the test measures them again through
`flexsparse.convert` (an independent path) and checks the removal order against them."""

import pytest
import torch

from tests.hf_util import KV_HEADS, LAYERS, VOCAB, tiny_model

pytest.importorskip("transformers")

SPARSE = dict(sink=4, window=8)


def _inputs(length: int = 96):
    from flexsparse.eval.tasks import Prompt
    from flexsparse.integrations.calibration import CalibrationInputs

    gen = torch.Generator().manual_seed(3)
    texts = CalibrationInputs(torch.randint(1, VOCAB, (2, length), generator=gen))
    prompts = [Prompt(torch.randint(1, VOCAB, (length,), generator=gen).tolist(), answer_len=3) for _ in range(2)]
    return texts, prompts


def _converted_loss(model, texts, prompts, sparse_heads: set[tuple[int, int]]) -> float:
    """Text NLL + answer NLL with ``sparse_heads`` sink+window, through flexsparse.convert (dense backend)."""
    import flexsparse
    from flexsparse.masks import Causal, SinkWindow

    modes = [["sparse" if (layer, head) in sparse_heads else "full" for head in range(KV_HEADS)]
             for layer in range(LAYERS)]
    flexsparse.convert(model, {"full": Causal(), "sparse": SinkWindow(**SPARSE)}, modes, backend="dense")
    try:
        with torch.no_grad():
            loss = float(model(input_ids=texts.ids, labels=texts.ids).loss)
            for prompt in prompts:
                ids = torch.tensor(prompt.ids)[None]
                logits = model(input_ids=ids).logits[0, -prompt.answer_len - 1:-1]
                loss += float(torch.nn.functional.cross_entropy(logits, ids[0, -prompt.answer_len:])) / len(prompts)
    finally:
        flexsparse.revert(model)
    return loss


@pytest.mark.parametrize("rounds", [1, LAYERS * KV_HEADS])
def test_greedy_order_follows_the_measured_loss(rounds):
    from flexsparse.integrations.calibration import GreedyOptions, greedy_scores
    from flexsparse.masks import SinkWindow

    model = tiny_model("llama")
    texts, prompts = _inputs()
    scores = greedy_scores(model, texts, prompts, SinkWindow(**SPARSE), options=GreedyOptions(rounds=rounds))
    heads = LAYERS * KV_HEADS
    assert scores.shape == (LAYERS, KV_HEADS)
    assert sorted(scores.flatten().tolist()) == list(range(heads))  # a removal order
    order = [divmod(int(i), KV_HEADS) for i in scores.flatten().argsort()]
    removed: set[tuple[int, int]] = set()
    for step, head in enumerate(order[:3 if rounds > 1 else 1]):
        candidates = [(layer, h) for layer in range(LAYERS) for h in range(KV_HEADS) if (layer, h) not in removed]
        costs = {c: _converted_loss(model, texts, prompts, removed | {c}) for c in candidates}
        assert costs[head] <= min(costs.values()) + 1e-4, (step, head, costs)
        removed.add(head)
    if rounds == 1:  # one round: the whole order is the single-head costs' order
        single = {(layer, h): _converted_loss(model, texts, prompts, {(layer, h)})
                  for layer in range(LAYERS) for h in range(KV_HEADS)}
        ranked = sorted(single, key=single.get)
        assert [single[h] for h in order] == pytest.approx([single[h] for h in ranked], abs=1e-4)


def test_greedy_selection_keeps_the_heads_kept_longest():
    from flexsparse.integrations.calibration import GreedyOptions, greedy_scores, select
    from flexsparse.masks import SinkWindow

    model = tiny_model("llama", seed=1)
    texts, prompts = _inputs()
    scores = greedy_scores(model, texts, prompts, SinkWindow(**SPARSE), options=GreedyOptions(rounds=2))
    modes = select(scores, 0.5, per_layer=False)
    kept = {(layer, head) for layer in range(LAYERS) for head in range(KV_HEADS) if modes[layer][head] == "full"}
    assert kept == {divmod(int(i), KV_HEADS) for i in scores.flatten().argsort()[-LAYERS * KV_HEADS // 2:]}


def test_greedy_options_are_checked():
    from flexsparse.integrations.calibration import GreedyOptions, greedy_scores
    from flexsparse.masks import SinkWindow

    texts, prompts = _inputs()
    with pytest.raises(ValueError, match="rounds"):
        greedy_scores(tiny_model("llama"), texts, prompts, SinkWindow(**SPARSE), options=GreedyOptions(rounds=0))
