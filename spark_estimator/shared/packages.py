"""The optional packages a fit may need, found the same way on the driver (to refuse a fit
early) and on the executors (to use them): petastorm, which imports only on the legacy stack
named in ``PETASTORM_STACK``, Lightning, which comes as two packages with separate class
hierarchies (``lightning.pytorch`` and ``pytorch_lightning``), and torchvision's GPU JPEG
decoder (``decode_device="cuda"``)."""

from __future__ import annotations

import importlib

PETASTORM_STACK = (
    "petastorm 0.13.1 with pyspark 3.5.9, pyarrow 14.0.2, numpy 1.26, pandas 2.2.3 and "
    "setuptools<70 (pip install 'spark-estimator[petastorm]' on that stack)"
)


def require_petastorm():
    """Import petastorm's ``make_batch_reader`` or raise an ImportError naming what works."""
    try:
        from petastorm import make_batch_reader
    except Exception as e:  # petastorm fails with AttributeError/ImportError on new pyarrow
        import pyarrow

        raise ImportError(
            f"reader: 'petastorm' cannot be used here: importing petastorm failed with "
            f"{type(e).__name__}: {e} (pyarrow {pyarrow.__version__}). It works with "
            f"{PETASTORM_STACK}; on newer stacks use reader='arrow' (the default)."
        ) from e
    return make_batch_reader


PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_package(model):
    """The Lightning package (module) whose LightningModule ``model`` is; None when it is
    none of them. An ImportError when no Lightning package can be imported."""
    found = []
    for name in PACKAGES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "model: LightningEstimator needs Lightning 2.x; pip install "
            "'spark-estimator[lightning]' (or lightning) on the driver and the executors"
        )
    return next((pl for pl in found if isinstance(model, pl.LightningModule)), None)


def require_gpu_jpeg():
    """torchvision's ``decode_jpeg`` and ``ImageReadMode``, or an ImportError naming
    ``decode_device`` (torchvision missing, or a wheel that does not load with this torch)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:
        raise ImportError(
            "decode_device: 'cuda' decodes JPEG images with torchvision.io.decode_jpeg, "
            f"which does not import here ({type(e).__name__}: {e}); install a torchvision "
            "built for the installed torch, or use decode_device='cpu'"
        ) from e
    return decode_jpeg, ImageReadMode
