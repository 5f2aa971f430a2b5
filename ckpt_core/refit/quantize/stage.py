"""``quantize_for_rollout`` as a refit stage: weights leave as the rollout's FP8 bytes and scales.

On a policy worker, each weight the destination names in its ``"weight_quantization"``
(:mod:`ckpt_core.refit.quantize`; a rollout that serves FP8 publishes it in its ``prepare()``
metadata) is cast to the rollout's dtype and sent as FP8 bytes followed by its scale, made with
the rollout's own arithmetic (:mod:`ckpt_core.refit.quantize.fp8`). It runs once per refit,
before the weights are split among destination streams (so a layout then names the scales
too), which is why every destination of one policy rank must hold the same quantization.
"""

from __future__ import annotations

from typing import ClassVar

from ckpt_core.errors import EngineOptionError, InvalidArgumentError
from ckpt_core.options import Option, OptionValues
from ckpt_core.refit.quantize import QuantizationSpec, quantize_weights
from ckpt_core.refit.stage import Destinations, RefitStage, Weights

__all__ = ["QuantizeStage"]


class QuantizeStage(RefitStage):
    """On with ``quantize_for_rollout`` (module docstring)."""

    options: ClassVar[tuple[Option, ...]] = (
        Option.flag(
            "quantize_for_rollout",
            False,
            "policy side: each weight the rollout's 'weight_quantization' names is sent as FP8 bytes "
            "and scales made with the rollout's own arithmetic (ckpt_core.refit.quantize)",
            agreed=True,
        ),
    )

    def __init__(self) -> None:
        self._spec: tuple[QuantizationSpec, str] | None = None  # and how messages name its rollouts

    @classmethod
    def from_options(cls, values: OptionValues, *, owner: str) -> QuantizeStage | None:
        return cls() if values.quantize_for_rollout else None

    def connect_policy(self, destinations: Destinations) -> None:
        """The destinations' ``"weight_quantization"``, which must be one."""
        owner = destinations.owner
        specs = []
        for rank in destinations.ranks:
            spec = destinations.published(rank).get("weight_quantization")
            if spec is None:
                raise InvalidArgumentError(
                    f"{owner}: quantize_for_rollout=True, but rollout rank {rank}'s prepare() metadata has no "
                    "'weight_quantization' (ckpt_core.refit.quantize): a rollout that holds weights quantized adds "
                    "it; for one that does not, turn quantize_for_rollout off on every worker"
                )
            specs.append(QuantizationSpec.from_json(spec, owner=f"{owner}: rollout rank {rank}'s weight_quantization"))
        if any(spec != specs[0] for spec in specs[1:]):
            raise EngineOptionError(
                f"{owner}: policy rank {destinations.worker_rank} quantizes its weights once for rollout ranks "
                f"{list(destinations.ranks)}, but their weight quantizations differ: serve them from policy ranks "
                "of their own"
            )
        self._spec = (specs[0], destinations.label) if specs else None

    def send(self, weights: Weights) -> Weights:
        if self._spec is None:
            return weights
        spec, label = self._spec
        return quantize_weights(weights, spec, destination=label)

    def finalize(self) -> None:
        self._spec = None
