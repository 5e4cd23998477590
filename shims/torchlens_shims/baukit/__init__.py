"""baukit's nethook dialect on TorchLens: port by changing only the import line.

``from baukit import Trace, TraceDict`` becomes ``from torchlens_shims.baukit import
Trace, TraceDict``; ``from baukit import nethook`` and ``from baukit.nethook import ...``
work the same way against ``torchlens_shims.baukit``. Everything lives in
:mod:`torchlens_shims.baukit.nethook`, whose docstring lists the deviations from baukit.

Only nethook is provided. baukit's other names (widgets, ``show``, running statistics,
datasets ...) raise ``ShimUnsupportedError`` on import, so a port fails with a remedy
instead of a bare ImportError.
"""

from __future__ import annotations

from typing import Any

from torchlens.errors import ShimUnsupportedError

from . import nethook
from .nethook import *  # noqa: F403 - the shim's names are exactly nethook's
from .nethook import __all__ as _NETHOOK_NAMES

__all__ = ["nethook", *_NETHOOK_NAMES]

# Names the real baukit package exports outside nethook.
_NOT_PROVIDED = frozenset(
    """
    Model Widget Trigger Property Event Button Label Textbox Numberbox Range ColorPicker
    Checkbox Choice Menu Datalist Div ClickDiv Img Textarea PaintWidget PlotWidget pbar
    reserve_dir ImageFolderSet renormalize Stat Mean Variance Covariance Bincount
    CrossCovariance IoU CrossIoU Quantile TopK Reservoir History CombinedStat tally show
    WorkerBase WorkerPool save_image_set TokenizedDataset move_to length_collation
    make_padded_batch flatten_masked_batch labwidget paintwidget plotwidget pidfile
    parallelfolder runningstats workerpool imgsave tokendataset
    """.split()
)


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise ShimUnsupportedError(
            f"torchlens_shims.baukit provides baukit's nethook only, not baukit.{name}",
            remedy="Keep importing that name from baukit itself; only nethook is replaced by the shim.",
            name=name,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
