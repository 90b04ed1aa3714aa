"""lm-eval's model interface on an already loaded (and possibly converted) model: :class:`FlexsparseLM`.

lm-eval (``pip install 'flexsparse[ruler]'``) runs any of its tasks on a subclass of its ``LM`` class; this one
hands lm-eval's requests to a :class:`~flexsparse.eval.text_model.TextModel`, which does the work (and is tested
without lm-eval). :mod:`flexsparse.eval.ruler` runs RULER on it; any lm-eval task whose data lm-eval can load
runs through lm-eval's own evaluator::

    import lm_eval
    from flexsparse.eval.harness import FlexsparseLM
    from flexsparse.eval.text_model import TextModel

    lm = FlexsparseLM(TextModel(model, tokenizer))      # model: flexsparse.convert(...)'d or not
    results = lm_eval.simple_evaluate(model=lm, tasks=[...])

Generation is greedy (sampling requests are a ValueError); chat templates are not applied.
"""

from __future__ import annotations

try:
    from lm_eval.api.model import LM
except ImportError as err:  # the optional extra
    raise ImportError("flexsparse.eval.harness needs lm-eval: pip install 'flexsparse[ruler]'") from err

from flexsparse.eval.text_model import TextModel


class FlexsparseLM(LM):
    """An lm-eval ``LM`` answering with ``text_model`` (its model stays as it is: convert it before, revert after).

    ``progress``: called with the number of requests done after each batch (e.g. a progress bar's ``update``).
    """

    def __init__(self, text_model: TextModel, progress=None) -> None:
        if not isinstance(text_model, TextModel):
            raise TypeError(f"text_model must be a flexsparse.eval.text_model.TextModel, got "
                            f"{type(text_model).__name__}")
        super().__init__()
        self.text_model = text_model
        self.progress = progress

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.text_model.loglikelihood([request.args for request in requests], self.progress)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self.text_model.loglikelihood_rolling([request.args[0] for request in requests], self.progress)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self.text_model.generate_until([request.args for request in requests], self.progress)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.text_model.tokenizer, "name_or_path", "") or "").replace("/", "__")
