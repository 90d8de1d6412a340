"""The algorithm maths: pure functions over masked tensors, selectable by name.

Importing the package registers every advantage estimator (:mod:`.estimators`) and policy loss
(:mod:`.policy_loss`, :mod:`.selective_loss`), so a name in a config always finds its entry.
"""

from purerl.algo import estimators, policy_loss, selective_loss  # noqa: F401 - they register their entries
