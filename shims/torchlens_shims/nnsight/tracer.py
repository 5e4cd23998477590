"""The context managers behind ``model.trace``, ``tracer.invoke``, ``model.session`` ...

Each one lifts its ``with`` body out of the caller's frame (see `_blocks`) and, in
``__exit__``, decides what running it means:

* `Tracer` (``model.session()``): run the body in place; values flow freely
  between the traces nested in it, and only saved ones leave the session.
* `InterleavingTracer` (``model.trace(...)``): run the body as a worker beside
  the model's forward; with no input, run the body first to collect its
  ``tracer.invoke(...)`` blocks and batch them into one forward.
* `Invoker`: register one batched input and its body with the parent trace.
* `EditingTracer` (``model.edit()``): store the body, to be replayed on every later
  trace. `ScanningTracer` (``model.scan()``): a trace under fake tensors.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import CodeType, FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from torch._subclasses.fake_tensor import FakeTensorMode

from . import _saving, _worker
from ._blocks import (
    Block,
    BlockScope,
    SkipBody,
    arm_skip,
    clear_shared,
    disarm,
    not_found_message,
    push,
    require_block,
    shared_store,
    snapshot,
)
from ._served import Served
from .barrier import Barrier
from .cache import CPU, Cache, CacheView
from .errors import (
    CacheOrderError,
    InvokeError,
    IterStepError,
    NNsightDeprecationWarning,
    OutOfOrderError,
)
from .interleaver import EarlyStopException

if TYPE_CHECKING:
    from .envoy import Envoy

__all__ = [
    "EditBlock",
    "ExitTracingException",
    "EditingTracer",
    "InterleavingTracer",
    "Invoker",
    "Iterations",
    "ScanningTracer",
    "Tracer",
    "clean_traceback",
    "push_result",
]

# nnsight's names for what the shim's tracing machinery raises and says (``nnsight.tracing.tracer``).
ExitTracingException = SkipBody
_not_found_message = not_found_message

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def push_result(frame: Any, variables: dict) -> None:
    """Hand a block's names back to ``frame``: only saved ones from the outermost trace."""
    if _saving.depth() == 1:
        variables = {key: value for key, value in variables.items() if _saving.is_marked(value)}
    push(frame, variables)


def clean_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the shim's own frames so an error points at the user's lines."""
    kept = []
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith(_PACKAGE_DIR) and "greenlet" not in filename:
            kept.append(tb)
        tb = tb.tb_next
    result = None
    for entry in reversed(kept):
        result = TracebackType(result, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return result


class Tracer:
    """Capture the ``with`` block at the call site; run it on exit (a session by default)."""

    def __init__(self) -> None:
        self._frame: FrameType | None = None
        self._block: Block | None = None

    def _capture(self, frame: FrameType) -> Block:
        if self._block is None or self._frame is not frame:
            self._block = require_block(frame)
            self._frame = frame
        return self._block

    def __enter__(self) -> Any:
        frame = sys._getframe(1)
        block = self._capture(frame)
        if block.runs_code:
            arm_skip(frame, block)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if exc_type is SkipBody:
            disarm(self._frame, exc_value)
        # This frame ends up in the traceback of whatever the body raises: it must not
        # hold exceptions (each holds its frames), or the block's values live on in a cycle.
        del exc_value, traceback
        if exc_type is not SkipBody and exc_type is not None:
            self._frame = None
            return False
        _saving.enter()
        try:
            self.execute(self._block.code)
        except BaseException as error:
            error.__context__ = None
            tb = getattr(error, "_shim_block_tb", None) or error.__traceback__
            try:
                raise error.with_traceback(clean_traceback(tb)) from error.__cause__
            finally:
                del error, tb
        finally:
            _saving.leave()
            self._frame = None
        return True

    def execute(self, code: CodeType) -> None:
        """Run the body in place and hand back its names (a session)."""
        frame = self._frame
        scope = BlockScope(snapshot(frame), {}, frame.f_globals)
        exec(code, scope)
        push_result(frame, scope.writes())


class Iterations(Tracer):
    """``tracer.iter[...]``: which visits of a repeated location a stretch of body targets.

    ``for step in tracer.iter[:3]:`` pins the running block's requests to visit
    ``step`` (then relaxes, so the rest of the step follows the model); the
    deprecated ``with tracer.iter[...]:`` form re-runs its body once per step.
    """

    def __init__(self, start: int = 0, stop: int | None = None, steps: list[int] | None = None) -> None:
        super().__init__()
        self.start = start
        self.stop = stop
        self.steps = steps

    def __getitem__(self, key: slice | int | list[int]) -> Iterations:
        if isinstance(key, slice):
            return Iterations(key.start or 0, key.stop)
        if isinstance(key, (list, tuple)):
            return Iterations(steps=list(key))
        return Iterations(key, key + 1)

    def _indices(self):
        if self.steps is not None:
            yield from self.steps
            return
        step = self.start
        while self.stop is None or step < self.stop:
            yield step
            step += 1

    def __iter__(self):
        current = _worker.current("tracer.iter")
        previous = current.iteration
        try:
            for step in self._indices():
                if step < 0:
                    raise IterStepError(f"tracer.iter step cannot be negative: {step}")
                current.iteration = step
                yield step
        finally:
            current.iteration = previous

    def execute(self, code: CodeType) -> None:
        frame = self._frame
        warnings.warn_explicit(
            "The `with tracer.iter[...]:` / `with tracer.all():` block form is deprecated; use "
            "`for step in tracer.iter[...]:` instead.",
            NNsightDeprecationWarning,
            frame.f_code.co_filename,
            self._block.node.lineno,
        )
        current = _worker.current("tracer.iter")
        previous = current.iteration
        scope = BlockScope(snapshot(frame), {}, frame.f_globals)
        try:
            for step in self._indices():
                if step < 0:
                    raise IterStepError(f"tracer.iter step cannot be negative: {step}")
                current.iteration = step
                exec(code, scope)
        except OutOfOrderError:
            pass  # fewer steps ran than asked for; keep what the reached steps saved
        finally:
            current.iteration = previous
        push_result(frame, scope.writes())


class InterleavingTracer(Tracer):
    """``with model.trace(...)``: the body runs as a worker beside the model's call."""

    result = Served("result")

    def __init__(self, envoy: Envoy, fn: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.envoy = envoy
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.batcher: Any = None
        self._workers: list[_worker.Worker] = []
        self.path = ""

    def __exit__(self, exc_type, exc_value, traceback) -> bool:
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            # Drop the model and inputs so a `tracer` name left bound frees nothing it shouldn't hold.
            self.envoy = None
            self.fn = None
            self.args = ()
            self.kwargs = {}
            self.batcher = None

    # -- the body's API -------------------------------------------------------------
    def stop(self) -> None:
        """End the model's run here; everything read so far is kept."""
        raise EarlyStopException()

    @property
    def iter(self) -> Iterations:
        return Iterations()

    def all(self) -> Iterations:
        """Every visit — shorthand for ``tracer.iter[:]``."""
        return Iterations()[:]

    def barrier(self, n: int) -> Barrier:
        """A meeting point for ``n`` of this trace's blocks."""
        return Barrier(n)

    def invoke(self, *args: Any, **kwargs: Any) -> Invoker:
        """Add one input (a group of batch rows) and a body scoped to those rows."""
        return Invoker(self, *args, **kwargs)

    def cache(
        self,
        modules: list[Any] | None = None,
        device: Any = CPU,
        dtype: Any = None,
        detach: bool = True,
        include_output: bool = True,
        include_inputs: bool = False,
        non_blocking: bool = False,
    ) -> CacheView:
        """Record many modules' (post-intervention) values during the run."""
        current = _worker.current("tracer.cache()")
        if current.pending is not None:
            raise CacheOrderError("tracer.cache() must be declared before reading or modifying a model value")
        cache = Cache(
            self.envoy,
            modules=modules,
            device=device,
            dtype=dtype,
            detach=detach,
            include_output=include_output,
            include_inputs=include_inputs,
            non_blocking=non_blocking,
        )
        current.caches.append(cache)
        return _saving.save(CacheView(cache, None))

    # -- running ----------------------------------------------------------------------
    def execute(self, code: CodeType) -> None:
        frame = self._frame
        glbls = frame.f_globals
        envoy = self.envoy
        self.batcher = envoy._batcher_class(envoy, self.kwargs)
        try:
            if envoy._batch_size(*self.args, **self.kwargs):
                body = _worker.Worker(code, BlockScope(snapshot(frame), {}, glbls))
                body.group = self.batcher.add(*self.args, **self.kwargs)
                self._workers.append(body)
                forward_kwargs: dict = {}
            else:
                forward_kwargs = dict(self.kwargs)
                scope = BlockScope(snapshot(frame), shared_store(frame), glbls)
                exec(code, scope)  # each `with tracer.invoke(...)` registers a worker
                push_result(frame, scope.writes())
                if not self._workers:
                    raise InvokeError("trace() needs an input, or at least one `with tracer.invoke(...)` block")
            workers = list(self._workers)
            envoy.interleave(self.fn, workers=workers, batcher=self.batcher, **forward_kwargs)
            for body in workers:
                push_result(frame, body.scope.writes())
        finally:
            self._workers = []
            clear_shared()


class Invoker(Tracer):
    """``with tracer.invoke(x):`` — one input of the batch and the body scoped to its rows."""

    def __init__(self, tracer: InterleavingTracer, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if tracer.envoy is None or tracer.envoy._tree.run is not None:
            raise InvokeError("cannot invoke while the model is already running")
        self.tracer = tracer
        self.args = args
        self.kwargs = kwargs

    def execute(self, code: CodeType) -> None:
        frame = self._frame
        body = _worker.Worker(code, BlockScope(snapshot(frame), shared_store(frame), frame.f_globals))
        body.group = self.tracer.batcher.add(*self.args, **self.kwargs)
        self.tracer._workers.append(body)


class EditBlock:
    """A stored ``model.edit()`` body: replayed, on a fresh copy of its names, every run."""

    def __init__(self, code: Any, names: dict, glbls: dict) -> None:
        self.code = code
        self.names = names
        self.glbls = glbls

    def spawn(self) -> _worker.Worker:
        return _worker.Worker(self.code, BlockScope(dict(self.names), {}, self.glbls), None, replay=True)


class EditingTracer(InterleavingTracer):
    """``with model.edit(...)``: store the body as a default intervention, run nothing now."""

    def __init__(self, envoy: Envoy, *, inplace: bool = False) -> None:
        if not inplace:
            envoy = envoy._shallow_copy()
        super().__init__(envoy, "__call__")
        self.inplace = inplace

    def __enter__(self) -> Any:
        frame = sys._getframe(1)
        block = self._capture(frame)
        if block.runs_code:
            arm_skip(frame, block)
        return self if self.inplace else (self, self.envoy)

    def execute(self, code: CodeType) -> None:
        frame = self._frame
        self.envoy._edits.append(EditBlock(code, snapshot(frame), frame.f_globals))


class ScanningTracer(InterleavingTracer):
    """``with model.scan(...)``: the same trace, run on fake tensors (shapes and dtypes only)."""

    def execute(self, code: CodeType) -> None:
        # Lazy: heavy (about 0.6 s and ~500 modules the first time), and only scan() needs it.
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(assume_static_by_default=True)):
            super().execute(code)
