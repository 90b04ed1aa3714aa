"""A causal LM behind a text interface: what evaluation harnesses ask of a model, batched.

:class:`TextModel` holds a model (a converted flexsparse model or any transformers causal LM) and its tokenizer and
answers the three requests of lm-eval's model interface, in lm-eval's argument formats, with no lm-eval import
(:mod:`flexsparse.eval.harness` puts lm-eval's ``LM`` class on it):

* :meth:`~TextModel.loglikelihood`: ``(context, continuation)`` pairs -> (log-probability of the continuation's
  tokens given the context, whether greedy decoding would produce them);
* :meth:`~TextModel.loglikelihood_rolling`: texts -> log-probability of the whole text (windows of the model's
  context, every token predicted once);
* :meth:`~TextModel.generate_until`: ``(context, generation kwargs)`` pairs -> greedy generations, cut at the first
  stop string.

Texts are encoded without special tokens (a prompt is the text as written, as lm-eval's HF model does by default);
an empty context is the prefix token (BOS, else EOS). Scoring forwards batch sequences of one length only, so a
method whose block selection depends on the input (XAttention) sees each sequence as it would alone; generation runs
left-padded batches through ``generate()`` (a converted model decodes through its sparse KV cache). Log-
probabilities are float32 natural logs; the LM head runs on the scored positions only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexsparse.eval.text import encode

DEFAULT_MAX_NEW_TOKENS = 256
"""New tokens of a generation request that names no ``max_gen_toks`` (lm-eval's default)."""


def hidden_states(model: nn.Module, ids: Tensor) -> Tensor:
    """Last hidden states ``[B, S, D]`` (after the final norm) of token ids ``[B, S]``, without a cache."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def lm_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """The LM head on ``hidden`` ``[..., D]``, float32, with the model's final logit soft-capping if it has one."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def pad_token(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _stop_tokens(model: nn.Module, tokenizer) -> set[int]:
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(found if isinstance(found, (list, tuple)) else [] if found is None else [found])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _longest_first(sizes: Sequence[int], tokens_per_batch: int) -> Iterator[list[int]]:
    """Indices in batches, longest sequences first, each batch at most ``tokens_per_batch`` tokens wide (at least
    one sequence)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    start = 0
    while start < len(order):
        count = max(1, tokens_per_batch // max(1, sizes[order[start]]))
        yield order[start:start + count]
        start += count


@torch.no_grad()
def greedy_generate(model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int | Sequence[int], tokens_per_batch: int,
                    progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of token-id prompts: per prompt its new tokens, at most its ``max_new_tokens``, up to
    the first end-of-sequence token (excluded). Left-padded batches, longest prompts first, about
    ``tokens_per_batch`` prompt tokens each; ``progress(k)`` after each batch of k prompts."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or any(b < 1 for b in budgets):
        raise ValueError(f"max_new_tokens must be >= 1 for each of the {len(prompts)} prompts, got {max_new_tokens}")
    device = next(model.parameters()).device
    pad, stops = pad_token(tokenizer), _stop_tokens(model, tokenizer)
    out: list[list[int]] = [[] for _ in prompts]
    for batch in _longest_first([len(p) for p in prompts], tokens_per_batch):
        width = len(prompts[batch[0]])
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            ids[row, width - len(prompts[index]):] = torch.tensor(list(prompts[index]), dtype=torch.long)
            mask[row, width - len(prompts[index]):] = 1
        new = max(budgets[i] for i in batch)
        generated = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                   do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        for row, index in enumerate(batch):
            tokens = generated[row, width:width + budgets[index]].tolist()
            ends = [i for i, token in enumerate(tokens) if token in stops]
            out[index] = tokens[:ends[0]] if ends else tokens
        if progress is not None:
            progress(len(batch))
    return out


class TextModel:
    """A causal LM and its tokenizer answering lm-eval's requests (see the module docstring).

    Args:
        model: a causal LM in eval mode (converted or not); it is not changed.
        tokenizer: its tokenizer.
        batch_tokens: tokens per forward (batches hold about this many tokens).
        max_length: the longest sequence a forward may take (default: the model's ``max_position_embeddings``);
            longer scoring inputs keep their last ``max_length`` tokens (lm-eval's convention), longer prompts
            are a ValueError.
    """

    def __init__(self, model: nn.Module, tokenizer, batch_tokens: int = 4096, max_length: int | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (a causal LM), got {type(model).__name__}")
        if not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise ValueError(f"batch_tokens must be an integer >= 1, got {batch_tokens!r}")
        if max_length is None:
            max_length = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2 (the model's config names none), got {max_length!r}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_tokens, self.max_length = batch_tokens, max_length

    @property
    def prefix_token(self) -> int:
        """The token an empty context stands for: BOS, else EOS, else the pad token."""
        for candidate in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return pad_token(self.tokenizer)

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of a context and of its continuation as the model sees them together: spaces that end the
        context open the continuation, and the continuation's ids are those of ``context + continuation`` after
        the context's (the continuation's own where a token spans the boundary)."""
        if not isinstance(context, str) or not isinstance(continuation, str):
            raise TypeError(f"a loglikelihood request is a (context, continuation) pair of strings, got "
                            f"({type(context).__name__}, {type(continuation).__name__})")
        if not continuation:
            raise ValueError(f"empty continuation after context {context[-40:]!r}: nothing to score")
        trailing = len(context) - len(context.rstrip(" "))
        if trailing:
            context, continuation = context[:-trailing], context[-trailing:] + continuation
        if not context:
            return [self.prefix_token], encode(self.tokenizer, continuation)
        whole, start = encode(self.tokenizer, context + continuation), encode(self.tokenizer, context)
        if whole[:len(start)] == start and len(whole) > len(start):
            return start, whole[len(start):]
        return start, encode(self.tokenizer, continuation)  # the two merged across the boundary: apart

    @torch.no_grad()
    def _score(self, pieces: Sequence[tuple[list[int], int]],
               progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """Per (ids, n): the summed log-probability of the last ``n`` tokens of ``ids`` given the tokens before
        them, and whether each is the greedy choice. Batches hold pieces of one length."""
        device = next(self.model.parameters()).device
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pieces)
        by_length: dict[int, list[int]] = {}
        for index, (ids, _) in enumerate(pieces):
            by_length.setdefault(len(ids), []).append(index)
        for size in sorted(by_length, reverse=True):
            group = by_length[size]
            per_batch = max(1, self.batch_tokens // size)
            for start in range(0, len(group), per_batch):
                batch = group[start:start + per_batch]
                ids = torch.tensor([pieces[i][0] for i in batch], dtype=torch.long, device=device)
                hidden = hidden_states(self.model, ids[:, :-1])
                for row, index in enumerate(batch):
                    n = pieces[index][1]
                    logprobs = F.log_softmax(lm_logits(self.model, hidden[row, -n:]), dim=-1)
                    targets = ids[row, -n:]
                    total = float(logprobs.gather(-1, targets[:, None]).sum())
                    results[index] = (total, bool((logprobs.argmax(-1) == targets).all()))
                if progress is not None:
                    progress(len(batch))
        return results

    def loglikelihood(self, requests: Sequence[tuple[str, str]],
                      progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """Per ``(context, continuation)``: (log P(continuation | context), whether greedy decoding produces it)."""
        pieces = []
        for context, continuation in requests:
            start, rest = self._pair(context, continuation)
            ids = (start + rest)[-(self.max_length + 1):]
            pieces.append((ids, min(len(rest), len(ids) - 1)))
        return self._score(pieces, progress)

    def loglikelihood_rolling(self, texts: Sequence[str],
                              progress: Callable[[int], None] | None = None) -> list[float]:
        """Per text: log P(text | prefix token), in disjoint windows of ``max_length`` predicted tokens (each
        window's first prediction sees the last token of the window before)."""
        pieces, owner = [], []
        for index, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise ValueError(f"loglikelihood_rolling needs non-empty strings, got {text!r}")
            ids = [self.prefix_token] + encode(self.tokenizer, text)
            for start in range(0, len(ids) - 1, self.max_length):
                window = ids[start:start + self.max_length + 1]
                pieces.append((window, len(window) - 1))
                owner.append(index)
        totals = [0.0] * len(texts)
        for index, (value, _) in zip(owner, self._score(pieces, progress)):
            totals[index] += value
        return totals

    def generate_until(self, requests: Sequence[tuple[str, Mapping]],
                       progress: Callable[[int], None] | None = None) -> list[str]:
        """Per ``(context, kwargs)``: the greedy generation after ``context``, cut before the first of
        ``kwargs["until"]`` (a string or a list of them), at most ``kwargs["max_gen_toks"]`` tokens (default
        :data:`DEFAULT_MAX_NEW_TOKENS`). Sampling (``do_sample`` or a temperature > 0) is a ValueError: evaluation
        here is greedy."""
        prompts, budgets, stops = [], [], []
        for context, kwargs in requests:
            budget, until = generation_options(kwargs)
            ids = encode(self.tokenizer, context) if context else [self.prefix_token]
            if len(ids) > self.max_length:
                raise ValueError(f"a prompt of {len(ids):,} tokens exceeds max_length {self.max_length:,}")
            prompts.append(ids)
            budgets.append(budget)
            stops.append(until)
        generated = greedy_generate(self.model, self.tokenizer, prompts, budgets, self.batch_tokens, progress)
        texts = []
        for tokens, until in zip(generated, stops):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cuts = [text.index(stop) for stop in until if stop in text]
            texts.append(text[:min(cuts)] if cuts else text)
        return texts


def generation_options(kwargs: Mapping) -> tuple[int, tuple[str, ...]]:
    """(new tokens, stop strings) of lm-eval generation kwargs (``max_gen_toks``, ``until``); ValueError for
    sampling or unknown settings."""
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"generation kwargs must be a mapping, got {type(kwargs).__name__}")
    known = {"until", "max_gen_toks", "do_sample", "temperature"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unsupported generation kwargs {unknown}; greedy generation takes {sorted(known)}")
    if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
        raise ValueError(f"sampling is not supported (do_sample={kwargs.get('do_sample')}, temperature="
                         f"{kwargs.get('temperature')}): evaluation here is greedy")
    until = kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    budget = kwargs.get("max_gen_toks", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"max_gen_toks must be an integer >= 1, got {budget!r}")
    return budget, until
