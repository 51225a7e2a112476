"""Kernel registry: every op has a torch reference and may have faster implementations.

An implementation declares what it needs of a device (`supports(device) -> bool`) and a priority;
`select(op, device)` returns the best one the device can run, and the reference is always there to
fall back to. Tests walk `ops()` and compare every implementation against its op's reference, so a
new kernel is tested by being registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def any_device(device: torch.device) -> bool:
    return True


@dataclass(frozen=True)
class KernelImpl:
    op: str
    name: str
    fn: Callable
    priority: int  # higher wins among those the device supports; the reference is 0
    supports: Callable[[torch.device], bool] = any_device
    # Optional load-time step: the op's weight argument as this implementation wants it (e.g. GGUF
    # blocks repacked into a kernel layout). Same arguments as the op minus its activations;
    # `fn` must still accept the unprepared form.
    prepare: Callable | None = None
    # Optional: (prepared weight, gate, up, activation) -> the activation act(gate, up) already
    # in the form this implementation's integer kernel reads (made in one launch with the
    # quantization), or None where it would not read such a form; `fn` then takes it as x.
    quantize_input: Callable | None = None
    # Optional: (prepared weight, x, residual or None, norm weight, eps) -> (the RMSNorm of
    # x + residual in that form, x + residual) in one launch, or None: the norm before the linear.
    # Given a list of prepared weights (a linear's parts): a list of such forms, one a part.
    quantize_norm: Callable | None = None
    # Optional: (prepared weight, like [T, K]) -> the layout (xquant.XLayout) in which this
    # implementation's integer kernel reads x of like's rows and dtype pre-quantized, or None:
    # for an op that makes x and can quantize it in its own launch (the attention before the
    # output projection)
    input_layout: Callable | None = None

    @property
    def is_reference(self) -> bool:
        return self.priority == 0


_REGISTRY: dict[str, list[KernelImpl]] = {}
_FORCED: dict[str, str] = {}  # op -> implementation name, while `forcing` is active


def register(
    op: str, name: str, priority: int = 0, supports=any_device, prepare=None, quantize_input=None,
    quantize_norm=None, input_layout=None,
):  # fmt: skip
    """Decorator: register `fn` as an implementation of `op` (priority 0 marks the reference)."""

    def wrap(fn: Callable) -> Callable:
        impls = _REGISTRY.setdefault(op, [])
        if any(i.name == name for i in impls):
            raise ValueError(f"kernel {name!r} is already registered for op {op!r}")
        if priority == 0 and any(i.is_reference for i in impls):
            raise ValueError(f"op {op!r} already has a reference implementation")
        impls.append(
            KernelImpl(
                op,
                name,
                fn,
                priority,
                supports,
                prepare,
                quantize_input,
                quantize_norm,
                input_layout,
            )  # fmt: skip
        )
        impls.sort(key=lambda i: -i.priority)
        return fn

    return wrap


def ops() -> list[str]:
    return sorted(_REGISTRY)


def implementations(op: str) -> list[KernelImpl]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown kernel op {op!r}; known: {', '.join(ops())}")
    return list(_REGISTRY[op])


def reference(op: str) -> KernelImpl:
    return next(i for i in implementations(op) if i.is_reference)


def select(op: str, device: torch.device | str) -> KernelImpl:
    """The highest-priority implementation of `op` that `device` supports (or the one
    `forcing` names)."""
    if op in _FORCED:
        return next(i for i in implementations(op) if i.name == _FORCED[op])
    device = torch.device(device)
    for impl in implementations(op):
        if impl.supports(device):
            return impl
    return reference(op)


@contextmanager
def forcing(choices: dict[str, str]) -> Iterator[None]:
    """Within the block, select(op) returns the implementation named choices[op] whatever the
    device: to run the Triton kernels under Triton's interpreter on a CPU (tests), or to pin
    one implementation when comparing them."""
    for op, name in choices.items():
        if not any(i.name == name for i in implementations(op)):
            raise KeyError(f"op {op!r} has no implementation {name!r}")
    saved = dict(_FORCED)
    _FORCED.update(choices)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def forced() -> dict[str, str]:
    """The choices `forcing` holds now (op -> implementation name), e.g. to pass them on to a
    pipeline's stage processes, which select their own kernels."""
    return dict(_FORCED)


def chosen(device: torch.device | str) -> dict[str, str]:
    """op -> the implementation select() gives on `device` (logged at start)."""
    return {op: select(op, device).name for op in ops()}


def prepare_weight(impl: KernelImpl, weight, *args):
    """`weight` as `impl` wants it at load time: its prepare hook's result, else `weight` itself.

    For "qlinear": prepare_weight(impl, qweight, ggml_type, shape) once, then
    impl.fn(x, prepared, ggml_type, shape) per call.
    """
    return weight if impl.prepare is None else impl.prepare(weight, *args)
