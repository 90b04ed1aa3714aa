"""RouterTrainer: trains the routers of a converted transformers model (and the sparsity constraint's multipliers)
with the model itself frozen (Elastic Attention, seed 000, Section 3.2; Flux Attention, seed 003, Section 3.1).

One step: the batch goes through the model with its routers in training mode (Gumbel-softmax at the scheduled
temperature, straight-through hard weights, every routed layer mixing its full and sparse outputs), the routers
pooling the prompt tokens only (``prompt_mask``); the loss is the LM loss on ``labels`` plus the
:class:`~flexsparse.routers.SparsityConstraint` regulariser on each sequence's MSR. AdamW with two groups: the
router parameters (lr 5e-4, weight decay 0.1) minimise it, the multipliers (lr 1e-3, no decay, ``maximize=True``)
maximise it; both follow linear warmup over the first 20% of steps then a cosine to 0; the router gradients are
clipped to ``max_grad_norm`` (None: not clipped).

Batches are dicts: ``input_ids`` and ``labels`` (-100 = no loss) long ``[B, S]``, optional ``attention_mask``
``[B, S]`` (1 = real token) and ``prompt_mask`` bool ``[B, S]`` (the tokens the routers pool, default the
attention mask), and ``task``: B task names known to the constraint.

Logging reads values on the host every ``log_every`` steps (one sync then): a record per logged step with loss,
LM loss, regulariser, MSR per task present, the multipliers per task, temperature and learning rate, appended to
``history``, passed to ``callback`` and written as a JSON line to ``log_file``. A progress bar shows the steps
(tqdm when installed, else a plain line per logged step). ``checkpoint_dir``: every ``checkpoint_every`` steps
and at the end of :meth:`train`, ``save_config`` of the model (router configs and weights) and
``constraint.json`` (targets and multipliers) in ``checkpoint_dir/step-<n>``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from flexsparse.integrations.routing import (
    last_routings,
    pooling_mask,
    routed_layers,
    router_parameters,
    training,
)
from flexsparse.integrations.serialization import save_config
from flexsparse.routers.constraint import SparsityConstraint, msr
from flexsparse.routers.relaxation import CosineAnneal, TemperatureSchedule
from flexsparse.validation import as_float, as_int

BATCH_KEYS = ("input_ids", "labels", "task")


def warmup_cosine(total_steps: int, warmup: float) -> Callable[[int], float]:
    """Learning-rate factor: linear from 1/w to 1 over the first ``w = ceil(warmup * total_steps)`` steps, then a
    cosine down to 0 at ``total_steps``."""
    warm = math.ceil(warmup * total_steps)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))

    return factor


class _Progress:
    """tqdm when installed (not a dependency), else one plain line per logged step on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.enabled, self.total = enabled, total
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc="routers")

    def update(self, step: int, record: dict | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if record is not None:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", tau=f"{record['tau']:.3f}")
        elif self.enabled and record is not None:
            msr_text = " ".join(f"{task}={value:.2f}" for task, value in record["msr"].items())
            print(f"routers step {step}/{self.total} loss {record['loss']:.4f} lm {record['lm_loss']:.4f} "
                  f"reg {record['regulariser']:+.4f} msr {msr_text}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RouterTrainer:
    """Trains only the routers of ``model`` (converted with ``router=...``) and ``constraint``'s multipliers.

    Args:
        model: a converted transformers causal LM with routers; every parameter that is not a router's is frozen
            here (``requires_grad=False``).
        constraint: per-task targets and multipliers (moved to the routers' device).
        total_steps: length of the run (learning-rate and default temperature schedules).
        router_lr, lambda_lr, weight_decay: AdamW settings of the two groups (weight decay on the routers only).
        warmup: fraction of steps of linear warmup before the cosine.
        max_grad_norm: clip of the router gradients' global norm (a finite number > 0), or None: no clipping.
            Either way the logged ``grad_norm`` is the norm before any clipping.
        schedule: temperature per step (default ``CosineAnneal(total_steps)``: 1.5 -> 1.0 over 60%).
        log_every, callback, log_file: logging (see the module docstring).
        checkpoint_dir, checkpoint_every: checkpoints (``checkpoint_every=None``: only at the end of ``train``).
        progress: show a progress bar.
        generator: for the Gumbel noise (reproducible runs).
    """

    def __init__(self, model: nn.Module, constraint: SparsityConstraint, total_steps: int, *,
                 router_lr: float = 5e-4, lambda_lr: float = 1e-3, weight_decay: float = 0.1, warmup: float = 0.2,
                 max_grad_norm: float | None = 1.0, schedule: TemperatureSchedule | None = None, log_every: int = 1,
                 callback: Callable[[dict], None] | None = None, log_file: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
                 progress: bool = True, generator: torch.Generator | None = None) -> None:
        if not isinstance(constraint, SparsityConstraint):
            raise TypeError(f"constraint must be a flexsparse.routers.SparsityConstraint, got "
                            f"{type(constraint).__name__}")
        if not isinstance(model, nn.Module) or not routed_layers(model):
            raise ValueError("model must be converted with routers: flexsparse.convert(model, ..., router='head')")
        self.model, self.constraint = model, constraint
        self.total_steps = as_int("total_steps", total_steps, minimum=1)
        if isinstance(max_grad_norm, float) and math.isinf(max_grad_norm):
            raise ValueError(f"max_grad_norm must be finite (None: no clipping), got {max_grad_norm}")
        self.max_grad_norm = None if max_grad_norm is None else as_float("max_grad_norm", max_grad_norm,
                                                                          positive=True)
        self.schedule = CosineAnneal(self.total_steps) if schedule is None else schedule
        if not callable(self.schedule):
            raise TypeError(f"schedule must map a step to a temperature, got {type(schedule).__name__}")
        self.log_every = as_int("log_every", log_every, minimum=1)
        self.callback, self.generator = callback, generator
        self.log_file = None if log_file is None else Path(log_file)
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.checkpoint_every = None if checkpoint_every is None else as_int("checkpoint_every", checkpoint_every,
                                                                             minimum=1)
        self.progress = bool(progress)
        self.router_params = router_parameters(model)
        trainable = {id(p) for p in self.router_params}
        for p in model.parameters():
            p.requires_grad_(id(p) in trainable)
        self.device = self.router_params[0].device
        constraint.to(self.device)
        self.optimizer = torch.optim.AdamW([
            {"params": self.router_params, "lr": as_float("router_lr", router_lr, positive=True),
             "weight_decay": as_float("weight_decay", weight_decay, minimum=0.0)},
            {"params": list(constraint.parameters()), "lr": as_float("lambda_lr", lambda_lr, positive=True),
             "weight_decay": 0.0, "maximize": True},
        ])
        factor = warmup_cosine(self.total_steps, as_float("warmup", warmup, minimum=0.0, maximum=1.0))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.step_count = 0
        self.history: list[dict] = []

    # ----- one step ----------------------------------------------------------------------------------------------

    def check_batch(self, batch: Mapping) -> dict:
        """The batch's tensors on the routers' device and its task indices ``[B]``; errors name the key."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a dict with {list(BATCH_KEYS)}, got {type(batch).__name__}")
        for key in BATCH_KEYS:
            if key not in batch:
                why = " (router training needs labels: -100 where no loss)" if key == "labels" else ""
                raise ValueError(f"batch has no {key!r}{why}; it needs {list(BATCH_KEYS)}")
        ids = batch["input_ids"]
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            raise ValueError("batch['input_ids'] must be a tensor [B, S]")
        inputs = {"input_ids": ids.to(self.device)}
        for key in ("labels", "attention_mask", "prompt_mask"):
            value = batch.get(key)
            if value is None:
                continue
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ids.shape):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"batch[{key!r}] must be a tensor [B, S] = {list(ids.shape)}, got {shape}")
            inputs[key] = value.to(self.device)
        tasks = batch["task"]
        if isinstance(tasks, str) or not isinstance(tasks, Iterable):
            raise TypeError(f"batch['task'] must be a list of B task names, got {type(tasks).__name__}")
        tasks = list(tasks)
        if len(tasks) != ids.shape[0]:
            raise ValueError(f"batch['task'] names {len(tasks)} tasks for {ids.shape[0]} sequences")
        unknown = sorted({str(t) for t in tasks if t not in self.constraint.task_names})
        if unknown:
            raise ValueError(f"batch['task'] holds task names {unknown} unknown to the constraint "
                             f"(known: {self.constraint.task_names})")
        inputs["task_ids"] = self.constraint.task_ids(tasks, self.device)
        return inputs

    def step(self, batch: Mapping) -> dict | None:
        """One optimisation step; returns the log record when this step is logged (else None)."""
        inputs = self.check_batch(batch)
        tau = float(self.schedule(self.step_count))
        mask = inputs.get("attention_mask")
        pool = inputs.get("prompt_mask", mask)
        with training(self.model, tau, generator=self.generator), pooling_mask(self.model, pool):
            out = self.model(input_ids=inputs["input_ids"], attention_mask=mask, labels=inputs["labels"],
                             use_cache=False)
            sparsity = msr([routing.sparse_weight for routing in last_routings(self.model)])  # [B]
            regulariser = self.constraint(sparsity, inputs["task_ids"])
            loss = out.loss + regulariser
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.max_grad_norm is None:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.router_params if p.grad is not None])
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.router_params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        record = None
        if self.step_count % self.log_every == 0 or self.step_count == self.total_steps:
            record = self._record(tau, loss, out.loss, regulariser, sparsity, inputs["task_ids"], grad_norm)
        if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
            self.checkpoint()
        return record

    def _record(self, tau: float, loss: Tensor, lm_loss: Tensor, regulariser: Tensor, sparsity: Tensor,
                task_ids: Tensor, grad_norm: Tensor) -> dict:
        names = self.constraint.task_names
        per_task, count = self.constraint.per_task_mean(sparsity.detach(), task_ids)
        per_task, count = per_task.tolist(), count.tolist()
        record = {
            "step": self.step_count, "loss": loss.item(), "lm_loss": lm_loss.item(),
            "regulariser": regulariser.item(), "tau": tau, "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item(),
            "msr": {name: value for name, value, n in zip(names, per_task, count) if n > 0},
            "lambda_1": dict(zip(names, self.constraint.lambda_1.tolist())),
            "lambda_2": dict(zip(names, self.constraint.lambda_2.tolist())),
        }
        self.history.append(record)
        if self.callback is not None:
            self.callback(record)
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with self.log_file.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        return record

    # ----- loop and checkpoints ----------------------------------------------------------------------------------

    def train(self, batches: Iterable[Mapping]) -> list[dict]:
        """Steps over ``batches`` until ``total_steps`` (or the batches run out); returns ``history``."""
        bar = _Progress(self.total_steps - self.step_count, self.progress)
        try:
            for batch in batches:
                if self.step_count >= self.total_steps:
                    break
                bar.update(self.step_count + 1, self.step(batch))
        finally:
            bar.close()
        if self.checkpoint_dir is not None:
            self.checkpoint()
        return self.history

    def checkpoint(self) -> Path:
        """Save the routers (``save_config``) and the constraint into ``checkpoint_dir/step-<n>``."""
        if self.checkpoint_dir is None:
            raise ValueError("checkpoint_dir is not set")
        directory = self.checkpoint_dir / f"step-{self.step_count}"
        save_config(self.model, directory)
        state = {**self.constraint.config(), "lambda_1": self.constraint.lambda_1.tolist(),
                 "lambda_2": self.constraint.lambda_2.tolist(), "step": self.step_count}
        (directory / "constraint.json").write_text(json.dumps(state, indent=2) + "\n")
        return directory
