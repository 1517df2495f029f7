"""A model given as a function () -> torch.nn.Module: built where it trains.

TorchEstimator's ``model`` may be such a function instead of a module: each process calls
it, so the pickle the driver sends holds the function, whatever the model's size, and the
driver builds the model only for the fitted ``TorchModel``. Built under
``torch.device("meta")`` its parameters have shapes but no memory; ``materialize`` gives
them memory on a device and initial values from their modules' ``reset_parameters`` (with
``parallelism="fsdp"``, after sharding: each process then allocates only its shard).
"""

from __future__ import annotations

import torch


def is_factory(model) -> bool:
    """Whether ``model`` (the param's value) is a function that builds the module."""
    return callable(model) and not isinstance(model, torch.nn.Module)


def build(model) -> torch.nn.Module:
    """The module ``model`` is, or builds when it is a function."""
    if not is_factory(model):
        return model
    built = model()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(
            f"model: the function must return a torch.nn.Module, got {type(built).__name__}"
        )
    return built


def _meta_tensors(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s own (not its children's) parameters and buffers on meta."""
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [name for name, tensor in own if tensor.is_meta]


def on_meta(model: torch.nn.Module) -> bool:
    return any(_meta_tensors(m) for m in model.modules())


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device memory on ``device`` and its initial values:
    every module holding meta parameters or buffers runs its ``reset_parameters()``
    (torch's layers all have one). A module without one is refused, naming the tensors
    that would otherwise start as uninitialized memory. Seed the generators first."""
    owners = [(name, m, _meta_tensors(m)) for name, m in model.named_modules()]
    owners = [(name, m, tensors) for name, m, tensors in owners if tensors]
    for name, module, tensors in owners:
        if not callable(getattr(module, "reset_parameters", None)):
            where = [f"{name}.{t}" if name else t for t in tensors]
            raise ValueError(
                f"model: {where} were built on the meta device, but their module "
                f"{type(module).__name__} has no reset_parameters() to initialize them; give "
                "it one, or build that module off the meta device"
            )
    model.to_empty(device=device)
    with torch.no_grad():
        for _, module, _ in owners:
            module.reset_parameters()
