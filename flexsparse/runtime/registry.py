"""The registry of specialised executors: those every HybridAttention plans with besides its backend's fused
executor (compiled flex, eager flex or dense), in preference order (a tie in cost goes to the earlier one).

Adding an executor is its module (an :class:`~flexsparse.runtime.executors.Executor` with ``accepts``, ``cost``
and ``run``), its test, and one line: ``register_executor(MyExecutor)``. Layers built afterwards plan with it, and
so do the sparse KV caches of models converted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

from flexsparse.runtime.esa_executor import EsaExecutor
from flexsparse.runtime.executors import Executor, SdpaExecutor
from flexsparse.runtime.fa4_executor import Fa4Executor
from flexsparse.runtime.fused_decode import FusedDecodeExecutor

ExecutorFactory = Callable[[], Executor]
"""Makes a layer's instance of an executor (an Executor subclass itself, or any callable without arguments)."""

_registered: list[ExecutorFactory] = []


def register_executor(factory: ExecutorFactory) -> ExecutorFactory:
    """Add an executor after those registered so far (usable as a class decorator); returns ``factory``."""
    if not callable(factory):
        raise TypeError(f"register_executor takes an Executor class or a callable making one, got "
                        f"{type(factory).__name__}")
    if factory in _registered:
        raise ValueError(f"{factory!r} is registered already")
    _registered.append(factory)
    return factory


def unregister_executor(factory: ExecutorFactory) -> None:
    """Remove a registered executor (layers built before keep theirs)."""
    if factory not in _registered:
        raise ValueError(f"{factory!r} is not registered; registered: {_registered}")
    _registered.remove(factory)


def registered_executors() -> list[Executor]:
    """A new instance of every registered executor, in registration order."""
    executors = [factory() for factory in _registered]
    for factory, executor in zip(_registered, executors):
        if not isinstance(executor, Executor):
            raise TypeError(f"registered executor factory {factory!r} made a {type(executor).__name__}, not an "
                            "Executor")
    return executors


register_executor(SdpaExecutor)
register_executor(EsaExecutor)
register_executor(Fa4Executor)
register_executor(FusedDecodeExecutor)
