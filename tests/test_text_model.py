"""TextModel (lm-eval's three requests on a model, no lm-eval import) on a tiny random Llama with a byte tokenizer.

Checks: log-likelihoods and greedy flags equal those of the model's own logits, one sequence at a time, whatever
the batching; an empty context is the EOS prefix; rolling log-likelihoods predict every token once in windows of
max_length; generations equal generate() of each prompt alone (also through a converted model's sparse KV cache),
keep their token budgets and are cut at the first stop string; bad requests and arguments name themselves.
"""

import pytest
import torch

from flexsparse.eval.text_model import TextModel, generation_options, greedy_generate
from flexsparse.integrations import convert, revert
from flexsparse.masks import Causal, SinkWindow
from tests.hf_util import KV_HEADS, LAYERS, byte_tokenizer, one_thread, tiny_model  # noqa: F401  (autouse fixture)

EOS = 256


@pytest.fixture(scope="module")
def tiny():
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, eos_token_id=EOS)
    return model, tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    """log P(ids[t] | ids[:t]) for t >= 1, from the model's own logits of the whole sequence, ``[len - 1]``."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _greedy(model, ids: list[int], count: int) -> bool:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -count - 1:-1]
    return bool((logits.argmax(-1) == torch.tensor(ids[-count:])).all())


def _greedy_continuation(model, tokenizer) -> tuple[str, str]:
    """A context and a one-character continuation that is the model's greedy choice after it."""
    for letter in "abcdefghijklmnopqrstuvwxyz":
        context = f"The {letter}"
        with torch.no_grad():
            choice = int(model(torch.tensor([_ids(tokenizer, context)])).logits[0, -1].argmax())
        text = tokenizer.decode([choice])
        if choice < EOS and _ids(tokenizer, text) == [choice]:
            return context, text
    raise AssertionError("no context whose greedy next token is a character")


def test_loglikelihood_equals_the_models_own_log_probabilities_in_any_batch(tiny):
    model, tokenizer = tiny
    greedy_pair = _greedy_continuation(model, tokenizer)
    requests = [("Hello", " world"), ("", "abc"), ("The cat ", "sat"), ("x" * 40, "yz"), greedy_pair,
                ("Hello", " there")]
    wide = TextModel(model, tokenizer, batch_tokens=4096).loglikelihood(requests)
    narrow = TextModel(model, tokenizer, batch_tokens=1).loglikelihood(requests)
    for (context, continuation), (value, greedy), (value_1, greedy_1) in zip(requests, wide, narrow):
        start = _ids(tokenizer, context.rstrip(" ")) if context else [EOS]  # its trailing space opens the answer
        ids = _ids(tokenizer, context + continuation) if context else start + _ids(tokenizer, continuation)
        expected = _log_probs(model, ids)[len(start) - 1:]
        assert value == pytest.approx(float(expected.sum()), abs=1e-4)
        assert greedy == _greedy(model, ids, len(ids) - len(start))
        assert (value_1, greedy_1) == pytest.approx((value, greedy), abs=1e-4)
        assert value < 0
    assert wide[4][1] and not all(greedy for _, greedy in wide)


def test_loglikelihood_keeps_the_last_max_length_tokens(tiny):
    model, tokenizer = tiny
    (value, _), = TextModel(model, tokenizer, max_length=16).loglikelihood([("z" * 30, "abc")])
    ids = (_ids(tokenizer, "z" * 30 + "abc"))[-17:]
    assert value == pytest.approx(float(_log_probs(model, ids)[-3:].sum()), abs=1e-4)


def test_rolling_loglikelihood_predicts_every_token_once_in_windows(tiny):
    model, tokenizer = tiny
    text = "The quick brown fox jumps over the lazy dog, twice."  # 51 tokens: 4 windows of 16 predictions
    ids = [EOS] + _ids(tokenizer, text)
    expected = sum(float(_log_probs(model, ids[start:start + 17]).sum()) for start in range(0, len(ids) - 1, 16))
    short, whole = TextModel(model, tokenizer, max_length=16).loglikelihood_rolling([text, "ab"])
    assert short == pytest.approx(expected, abs=1e-3)
    assert whole == pytest.approx(float(_log_probs(model, [EOS] + _ids(tokenizer, "ab")).sum()), abs=1e-4)
    (alone, _), = TextModel(model, tokenizer).loglikelihood([("", text)])
    assert TextModel(model, tokenizer).loglikelihood_rolling([text])[0] == pytest.approx(alone, abs=1e-4)


def _generate_alone(model, tokenizer, prompt: str, count: int) -> list[int]:
    ids = torch.tensor([_ids(tokenizer, prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False,
                             pad_token_id=EOS)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


@pytest.mark.parametrize("converted", [False, True])
def test_generations_equal_each_prompt_alone_keep_budgets_and_stop(tiny, converted):
    model, tokenizer = tiny
    prompts = ["Once upon a time", "A", "The grass is green. The sky is", "Numbers: 1 2 3 4 5 6 7"]
    budgets = [12, 5, 9, 7]
    if converted:
        convert(model, {"full": Causal(), "ring": SinkWindow(2, 8)}, [["full", "ring"]] * LAYERS,
                backend="dense", block_size=16)
    try:
        expected = [_generate_alone(model, tokenizer, p, b) for p, b in zip(prompts, budgets)]
        batched = greedy_generate(model, tokenizer, [_ids(tokenizer, p) for p in prompts], budgets, 4096)
        texts = TextModel(model, tokenizer, batch_tokens=64).generate_until(
            [(p, {"max_gen_toks": b, "until": []}) for p, b in zip(prompts, budgets)])
        stop = texts[0][3:5]  # a stop string found in the first generation
        cut = TextModel(model, tokenizer).generate_until([(prompts[0], {"max_gen_toks": 12,
                                                                        "until": [stop, "not there"]})])
    finally:
        if converted:
            revert(model)
    assert batched == expected
    assert all(len(tokens) <= budget for tokens, budget in zip(batched, budgets))
    assert texts == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
    assert cut == [texts[0][:texts[0].index(stop)]]


def test_generation_options_and_bad_requests(tiny):
    model, tokenizer = tiny
    assert generation_options({"until": "\n", "max_gen_toks": 3, "do_sample": False, "temperature": 0.0}) == (
        3, ("\n",))
    assert generation_options({}) == (256, ())
    for kwargs, message in [({"do_sample": True}, "sampling"), ({"temperature": 0.7}, "sampling"),
                            ({"top_p": 0.9}, "unsupported generation kwargs"), ({"max_gen_toks": 0}, "max_gen_toks")]:
        with pytest.raises(ValueError, match=message):
            generation_options(kwargs)
    text_model = TextModel(model, tokenizer, max_length=32)
    with pytest.raises(ValueError, match="exceeds max_length 32"):
        text_model.generate_until([("y" * 40, {"max_gen_toks": 2})])
    with pytest.raises(ValueError, match="empty continuation"):
        text_model.loglikelihood([("abc", "")])
    with pytest.raises(TypeError, match="pair of strings"):
        text_model.loglikelihood([("abc", 3)])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        TextModel("model", tokenizer)
    with pytest.raises(ValueError, match="batch_tokens"):
        TextModel(model, tokenizer, batch_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, tokenizer, [[1, 2]], [0], 64)
