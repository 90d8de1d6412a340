"""The algorithm maths: pure functions over masked tensors, selectable by name.

Importing the package registers every advantage estimator (:mod:`.estimators`) and policy loss
(:mod:`.policy_loss`, :mod:`.selective_loss`), so a name in a config always finds its entry.
"""

from purerl.algo import estimators, policy_loss, selective_loss  # noqa: F401 - they register their entries
from purerl.algo.estimators import ADVANTAGE_ESTIMATORS, AdvantageSettings
from purerl.algo.kl_control import make_kl_controller
from purerl.algo.loss_records import POLICY_LOSSES
from purerl.algo.loss_settings import LossOptions, PolicyLossSettings

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "AdvantageSettings", "LossOptions", "PolicyLossSettings",
           "make_kl_controller"]
