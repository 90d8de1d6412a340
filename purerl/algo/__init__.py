"""The algorithm maths: pure functions over masked tensors, selectable by name.

The registries (:mod:`.registries`) know every built-in name at once and import the module that
registers an entry (:mod:`.estimators`, :mod:`.policy_loss`, …) on the first lookup, so a name in
a config always finds its entry. The names below are imported when first read: importing the
package (to check a config against the registries' names) imports no torch.
"""

import importlib
from typing import Any

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "AdvantageSettings", "LossOptions", "PolicyLossSettings",
           "make_kl_controller"]

_HOMES = {"ADVANTAGE_ESTIMATORS": "registries", "POLICY_LOSSES": "registries",
          "AdvantageSettings": "advantage_settings", "LossOptions": "loss_settings",
          "PolicyLossSettings": "loss_settings", "make_kl_controller": "kl_control"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
